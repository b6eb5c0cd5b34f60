"""The guard of a run's --output_dir and the checkpoint it resumes, before anything is written
(check_resume_and_output), and the trial checkpoint before step 1 (trial_checkpoint). Each is started by
one line of the script; without them the run trains the same.

- One run at a time in an --output_dir: the main process holds a lock on OUTPUT_DIR/.run.lock (filelock's
  flock; its host and pid inside) from its start to its exit. The kernel releases it when the process dies,
  however it dies, so a lock file that is there but not held is a killed run's, taken over (and said).
- The checkpoint to resume, checked before anything is built (common/resume_checks.py, imported by a
  resumed run only); a run already at --max_steps is nothing to do. A new run on top of another is refused;
  --overwrite_output_dir clears the old one.
- The trial checkpoint: a run that will save tries it once before step 1 (the same save into
  OUTPUT_DIR/.trial_checkpoint, read back as a resume reads it, removed: resume_checks.try_checkpoint), so a
  checkpoint that cannot be written or read back fails there, in one line, with nothing trained.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import time
from pathlib import Path

from accelerate.utils import gather_object
from filelock import FileLock, Timeout

from .checkpoint_format import checkpoints_dir
from .errors import UsageError
from .run_state import RELEASE_AT_END


def check_resume_and_output(accelerator, args, resume_path: Path | None, facts: dict) -> None:
    """Collective, before anything is written: lock --output_dir for this run, check the checkpoint to resume
    against this run's `facts` (common/checkpoint.py's start_point found both), refuse to start a run on top of
    another, clear it on --overwrite_output_dir."""
    outcome = None
    if accelerator.is_main_process:  # the global main process alone: the nodes of one run share the folder
        try:
            outcome = {"taken_over": lock_output_dir(args.output_dir)}
        except UsageError as e:
            outcome = {"refused": str(e)}
    outcome = gather_object([outcome])[0]  # every rank learns the main process's outcome (and waits for it)
    if "refused" in outcome:
        raise UsageError(outcome["refused"])
    if outcome["taken_over"]:
        accelerator.print(outcome["taken_over"])
    if resume_path:
        from .resume_checks import check_resumable  # only a resumed run reads a checkpoint

        check_resumable(accelerator, args, resume_path, facts)
    # `auto` without a checkpoint starts over: what an earlier attempt wrote before its first
    # checkpoint is replaced, as with --overwrite_output_dir
    overwrite = args.overwrite_output_dir or (args.resume_from_checkpoint == "auto" and resume_path is None)
    out = Path(args.output_dir)
    if ((out / "metrics.jsonl").exists() or checkpoints_dir(out).exists()) and not resume_path and not overwrite:
        raise UsageError(  # a new run on top of another would lose its metrics and checkpoints
            f"--output_dir {out} already holds a run: continue it with --resume_from_checkpoint latest, start over "
            "with --overwrite_output_dir, or choose another --output_dir"
        )
    if args.resume_from_checkpoint == "auto":
        found = f"resuming from {resume_path}" if resume_path else "no complete checkpoint, starting from step 0"
        accelerator.print(f"--resume_from_checkpoint auto: {found}")
    if overwrite and not resume_path and accelerator.is_main_process:  # the old run's files go
        for path in (out / "metrics.jsonl", out / "checkpoints", out / "model"):
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    accelerator.wait_for_everyone()


# ---------------------------------------------------------------- the run's lock on its --output_dir
# One run writes to an --output_dir at a time: two would log the same steps twice and publish over each
# other's checkpoints.
LOCK_FILE = ".run.lock"
_held_locks: list[dict] = []  # this process's: {"lock", "path", "made", "pid"} (made: the folder it created, or None);
# two where the cut check runs the script again on a shrunken copy (common/shrunk.py), in a folder of its own


def lock_output_dir(output_dir) -> str | None:
    """Take the run's lock on `output_dir` (made if missing); a second run is refused in one line, and so is a
    folder that cannot be written. Returns the line to print when a killed run's lock was taken over."""
    out = Path(output_dir)
    made = next((d for d in reversed([out, *out.parents]) if not d.exists()), None)  # the topmost missing folder
    path, previous = out / LOCK_FILE, []

    def write_holder(fd: int) -> None:  # filelock's callback, the lock held: who holds it, for a second run
        previous.append(os.pread(fd, 4096, 0))
        os.ftruncate(fd, 0)
        record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.pwrite(fd, json.dumps(record).encode(), 0)

    lock = FileLock(path, blocking=False, on_acquired=write_holder)
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    except Timeout:
        raise UsageError(
            f"--output_dir {out} is in use by another run ({_lock_holder(_read(path))}): wait for it to end, or "
            "choose another --output_dir (two runs in one folder would write over each other's checkpoints)"
        ) from None
    except OSError as e:  # a read-only or full file system, no permission: before step 1, not at the first record
        if made is not None:
            _remove_empty_folders(out, made)
        raise UsageError(
            f"--output_dir {out} cannot be written ({e.strerror or type(e).__name__}): give a writable --output_dir"
        ) from None
    _held_locks.append({"lock": lock, "path": path, "made": made, "pid": os.getpid()})
    if release_output_dir not in RELEASE_AT_END:  # every exit of run_main, and any other exit of the interpreter
        RELEASE_AT_END.append(release_output_dir)
        atexit.register(release_output_dir)
    if previous and previous[0].strip():
        return (
            f"--output_dir {out}: taking over the lock of a run that ended without releasing it "
            f"({_lock_holder(previous[0])}, no longer running)"
        )
    return None


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def _lock_holder(content: bytes) -> str:
    try:
        holder = json.loads(content)
        return f"host {holder['host']}, pid {holder['pid']}, started {holder['started']}"
    except (ValueError, TypeError, KeyError):
        return "its holder unknown"


def release_output_dir() -> None:
    """Remove the lock file and let go of the lock; a folder the lock made stays only if the run wrote to it."""
    while _held_locks and _held_locks[-1]["pid"] == os.getpid():  # a forked child's exit leaves its parent's
        held = _held_locks.pop()
        Path(held["path"]).unlink(missing_ok=True)  # before the lock goes: a run waiting on it then sees no file
        held["lock"].release()
        if held["made"] is not None:
            _remove_empty_folders(Path(held["path"]).parent, held["made"])


def _remove_empty_folders(folder: Path, up_to: Path) -> None:
    """rmdir `folder` and its parents up to `up_to`, while empty (a refused run leaves no folder it made)."""
    for d in [folder, *folder.parents]:
        try:
            d.rmdir()
        except OSError:
            return
        if d == up_to:
            return


def trial_checkpoint(accelerator, args, facts: dict, model, optimizer, scheduler, per_rank_state: bool = False) -> None:
    """Collective, after load_checkpoint, in a run that will save checkpoints (--checkpoint_every, --stop_at_step):
    the run's own save into OUTPUT_DIR/.trial_checkpoint, read back as a resume reads it, removed
    (resume_checks.try_checkpoint); `per_rank_state` as the run's saves (Local SGD: True). It changes nothing."""
    if not (getattr(args, "checkpoint_every", 0) or getattr(args, "stop_at_step", None)):
        return  # a run that saves no checkpoint has none to try
    from .resume_checks import try_checkpoint  # the save, and what a resume does with it

    try_checkpoint(accelerator, args.output_dir, facts, model, optimizer, scheduler, per_rank_state)
