"""Runs several training runs in turn in one launch: `accelerate launch ... tests/zoo_driver.py CASES.json`.

Start-up dominates a tiny run on this machine (4-5 s per process: torch, transformers, the process
group), so the zoo matrix (test_hf_zoo.py) runs every family of one script in one launch: each case is
`python scripts/<script> <args>` run as __main__ in this interpreter, on the process group the first
case made (kept alive between the cases; Accelerate's singletons are reset). CASES.json:
{"cases": [[script path, [args](, {env: the case's own})], ...], "results": path}; rank 0 writes
[{"returncode", "stdout", "stderr"}, ...].
Used by the zoo, the 🤗 EP and PP-stage tests, and shared_run.in_turn (tests/conftest.py)."""

import contextlib
import io
import json
import os
import runpy
import sys
import traceback

import torch.distributed as dist
from accelerate.state import AcceleratorState, GradientState

spec = json.loads(open(sys.argv[1]).read())
sys.path.insert(0, str(__import__("pathlib").Path(spec["cases"][0][0]).resolve().parent))
import common.faults
import common.launch  # the scripts' own module (on the path above): its end_process_groups ends the launch

common.faults.USAGE_ERROR_GRACE_S = 0  # a refusal is every rank's here, and rank 0's line is kept: no wait
keep_group = dist.destroy_process_group
dist.destroy_process_group = lambda *a, **k: None  # the next case runs on the same group
results = []
for script, args, *env in spec["cases"]:
    sys.argv, out, err, code = [script, *args], io.StringIO(), io.StringIO(), 0
    kept_env = dict(os.environ)
    os.environ.update(*env)  # a case's own variables, for it alone
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except BaseException:
            code = 1
            err.write(traceback.format_exc())
    results.append({"returncode": code, "stdout": out.getvalue()[-8000:], "stderr": err.getvalue()[-4000:]})
    os.environ.clear()
    os.environ.update(kept_env)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
if not dist.is_initialized() or dist.get_rank() == 0:
    open(spec["results"], "w").write(json.dumps(results))
dist.destroy_process_group = keep_group
common.launch.end_process_groups()
