"""Run a training script the way its `__main__` does (run_main), and say at interpreter shutdown
how many of the process groups it created are still alive:

    accelerate launch ... tests/exit_probe.py train_hybrid.py [flags]
    -> "rank R: process groups alive at exit: 0 of 6"

atexit handlers run before Python starts tearing modules down, so a group alive then would be
freed by the interpreter's shutdown: where gloo's C++ teardown used to abort finished runs
(docs/fault-tolerance.md, "Clean exits"). tests/test_exits.py launches it."""

import atexit
import os
import runpy
import sys
import weakref
from pathlib import Path

import torch.distributed as dist
from torch.distributed import distributed_c10d

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"  # each script puts its own folder on sys.path

created: list[weakref.ref] = []
make_group = distributed_c10d._new_process_group_helper


def recording_make_group(*args, **kwargs):
    """Every group torch makes (the world group, the mesh's, the flattened dp group) goes through here."""
    result = make_group(*args, **kwargs)
    group = result[0] if isinstance(result, tuple) else result
    if isinstance(group, dist.ProcessGroup):
        created.append(weakref.ref(group))
    return result


distributed_c10d._new_process_group_helper = recording_make_group


@atexit.register
def report() -> None:
    alive = sum(ref() is not None for ref in created)
    print(f"rank {os.environ.get('RANK', '0')}: process groups alive at exit: {alive} of {len(created)}", flush=True)


script = SCRIPTS / sys.argv.pop(1)
sys.argv[0] = str(script)
runpy.run_path(str(script), run_name="__main__")  # its `if __name__ == "__main__": run_main(main)`
