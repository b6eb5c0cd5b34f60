"""How a run that fails says so: the one line for a collective that failed because a peer froze or
died (gloo's and DCP's messages read here), the line written for the launcher's failure table
(TORCHELASTIC_ERROR_FILE), and the grace a rank gives rank 0 to report a bad-input error. A training
run imports it only when it fails (launch.run_main)."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import traceback
from pathlib import Path

import torch

from .errors import RunPosition

# How long a rank other than 0 waits, after a bad-input error, for rank 0 to report it.
USAGE_ERROR_GRACE_S = 20.0


def wait_for_rank0_to_report() -> None:
    """Most bad input fails the same check on every rank, and rank 0 says so once. A rank that
    exited first would make the launcher stop rank 0 before it printed its line, so the others
    wait: when rank 0 exits the launcher ends them (default SIGTERM, not the preemption
    handler). A rank still alive after the grace period saw an error of its own and prints it."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    time.sleep(USAGE_ERROR_GRACE_S)


# What gloo says when a peer stops answering (--collective_timeout passed) or goes away.
TIMEOUT_SIGNS = ("timed out", "timeout caused pair closure", "timeout waiting", "socket timeout")
GONE_SIGNS = ("connection closed by peer", "connection reset by peer", "broken pipe", "read error", "socket closed")


def lost_peer_line(error: BaseException) -> str | None:
    """The one line for a collective that failed because a peer froze or died, or None if `error`
    is something else. It names the step (RunPosition), the collective the process waited in and
    where, and the troubleshooting section."""
    from torch.distributed.checkpoint.api import CheckpointException

    if not isinstance(error, (RuntimeError, CheckpointException)):
        return None
    text = str(error).lower()
    if any(sign in text for sign in TIMEOUT_SIGNS):
        seconds = f"{RunPosition.collective_timeout:g} s" if RunPosition.collective_timeout else "too long"
        what = f"waited {seconds} for a peer that did not answer (it froze, was stopped, or is far too slow)"
    elif any(sign in text for sign in GONE_SIGNS):
        what = "lost its connection to a peer (it died or was killed: its own output says why)"
    else:
        return None
    rank = f"rank {torch.distributed.get_rank()}" if torch.distributed.is_initialized() else "this process"
    # gloo's own words, without its source location ("[.../unbound_buffer.cc:78] Timed out ...")
    detail = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip().splitlines()[0] if str(error).strip() else "")
    return (
        f"error: {RunPosition.describe()}: {collective_waited_for(error)} {what}; seen by {rank}"
        f" ({detail[:160] or type(error).__name__}). Continue with --resume_from_checkpoint auto once every"
        ' process can run (docs/troubleshooting.md, "A peer did not answer, or was lost")'
    )


def collective_waited_for(error: BaseException) -> str:
    """Which collective the process was waiting in, and where in our code, from the traceback: the
    innermost torch.distributed call; else backward (DDP's gradient all-reduce runs in C++ hooks);
    else what StepFeed said it was waiting for (an asynchronous all-reduce's wait())."""
    frames = traceback.extract_tb(error.__traceback__)
    scripts_dir = str(Path(__file__).resolve().parents[1])
    ours = [f for f in frames if f.filename.startswith(scripts_dir)]
    where = f" at {Path(ours[-1].filename).name}:{ours[-1].lineno}" if ours else ""
    c10d = [f.name for f in frames if f.filename.endswith("distributed_c10d.py") and not f.name.startswith("_")]
    torch_dist = [f.name for f in frames if f"{os.sep}torch{os.sep}distributed{os.sep}" in f.filename]
    if c10d:
        name = c10d[-1]
    elif any(f"{os.sep}torch{os.sep}autograd{os.sep}" in f.filename for f in frames):
        name = "all_reduce (gradient sync in backward)"
    elif RunPosition.waiting:
        name = RunPosition.waiting
    elif torch_dist:
        name = f"a collective (in torch.distributed's {torch_dist[-1]})"
    else:
        name = "a collective"
    return name + where


def report_to_launcher(message: str) -> None:
    """Under torchrun (and `accelerate launch`, which runs torchrun), a failed worker ends in the
    launcher's traceback and failure table. The table shows what the worker wrote to its
    TORCHELASTIC_ERROR_FILE: writing our one line there makes the table's last lines repeat it,
    instead of "To enable traceback see: ..." (docs/troubleshooting.md, "A traceback after the error line")."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        try:
            with open(path, "w") as f:
                json.dump({"message": message, "timestamp": int(time.time())}, f)
        except OSError:
            pass
