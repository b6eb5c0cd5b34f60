"""Records which generator state each dropout call of a training run draws from, on every rank.

    accelerate launch ... tests/dropout_probe.py RECORD_DIR tests/zoo_driver.py CASES.json

runs the program after RECORD_DIR (here the in-turn driver, so several runs share one launch) as
`python PROGRAM ...` would, with torch.nn.functional.dropout wrapped: each call in a training step appends a
digest of torch's CPU generator state to the list of the run's --output_dir (not the calls of the checks
before step 1, which run without gradients, the generator forked: the layer drop's, CP's attention probe). Rank r writes
RECORD_DIR/rank_<r>.json: {output_dir: [digest, ...]} (tests/test_dropout.py: the masks two ranks
draw are the same exactly when their digests are).
"""

import hashlib
import json
import os
import runpy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

record_dir, program, *program_args = sys.argv[1:]
digests: dict[str, list[str]] = {}
plain_dropout = F.dropout


def recording_dropout(input, p=0.5, training=True, inplace=False):
    if training and p > 0 and torch.is_grad_enabled():  # a step's; the start-up probes put the generator back
        argv = sys.argv  # the in-turn driver sets each run's argv before running it
        run = argv[argv.index("--output_dir") + 1] if "--output_dir" in argv else ""
        digests.setdefault(run, []).append(hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16])
    return plain_dropout(input, p, training, inplace)


F.dropout = recording_dropout  # nn.Dropout looks F.dropout up at each call
sys.argv = [program, *program_args]
try:
    runpy.run_path(program, run_name="__main__")
finally:
    Path(record_dir).mkdir(parents=True, exist_ok=True)
    (Path(record_dir) / f"rank_{os.environ.get('RANK', '0')}.json").write_text(json.dumps(digests))
