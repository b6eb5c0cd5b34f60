"""Checkpoints and the final model.

    OUTPUT_DIR/checkpoints/step_<N>/
        state/               model + optimizer through torch.distributed.checkpoint (DCP), under
                             the full model's parameter names: each rank writes what it owns, so
                             the same format serves replicated (DDP) and sharded strategies
        trainer_state.json   step, data position, global batch, model config, the size and sha256
                             of every other file of the checkpoint, and the sha256 of its own content
                             (written last)
        scheduler.pt         LR schedule
        rng/rank_<r>.pt      every rank's RNG (python, numpy, torch, cuda)
        extra_state.pt       a strategy's own state, if it has one (DiLoCo's outer optimizer)
    OUTPUT_DIR/model/        model.safetensors + config.json (+ data.json: which data it learned,
                             + task.json: where a Task of the user's own lives, for evaluate.py)

A save is written to `checkpoints/.tmp_step_<N>` and renamed once complete, so a kill at any moment
leaves the previous checkpoint (docs/fault-tolerance.md); a save that fails (a full disk) removes it and
is one line. A run that will save tries it once before step 1 (load_checkpoint: the same save into
OUTPUT_DIR/.trial_checkpoint, read back as a resume reads it, removed). `model/` is written beside itself
(OUTPUT_DIR/.export_model) and renamed once whole; a failed export removes it and is one line. A resume
checks every file against trainer_state.json first, and trainer_state.json itself against its digest: a
damaged one is one line. A run holds a lock on its --output_dir (OUTPUT_DIR/.run.lock)
from its start to its exit. Save, load and export are collectives: every rank calls them. Checkpoints and
`model/` need a file system shared by all machines.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import hashlib
import inspect
import json
import os
import random
import re
import shutil
import socket
import time
import warnings
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from accelerate.utils import gather_object
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from .batchnorm import average_running_stats
from .errors import RELEASE_AT_END, NothingToDo, UsageError

STATE_FILE = "trainer_state.json"
STATE_DIGEST_KEY = "state_sha256"  # in trainer_state.json: the sha256 of the rest of it (state_digest)
EXTRA_STATE_FILE = "extra_state.pt"  # a strategy's own state (save_checkpoint(extra_state=...))
TASK_FILE = "task.json"  # in model/: where a Task of the user's own lives (evaluate.py rebuilds the model with it)
# Optimizer state keyed by parameter name ("optim.state.blocks.3.mlp.up_proj.weight.exp_avg"),
# not by position in a param group: pipeline stages hold different parameters in "the same"
# groups, and another layout must find each parameter's state by its name.
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# The flags that shape what a step trains on (the batches' masks, BatchNorm's statistics): a resume with
# another value would go on silently as another run, so the checkpoint records them (check_same_data_flags).
DATA_FLAGS = ("document_mask", "sync_batchnorm")


def _checkpoints_dir(output_dir) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(output_dir) -> list[Path]:
    """Complete checkpoints, oldest first (a temp dir of an interrupted save is not one)."""
    root = _checkpoints_dir(output_dir)
    found = [p for p in root.glob("step_*") if re.fullmatch(r"step_\d+", p.name)] if root.is_dir() else []
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def resolve_checkpoint(arg: str | None, output_dir) -> Path | None:
    if arg is None:
        return None
    found = list_checkpoints(output_dir) if arg in ("auto", "latest") else None
    if arg == "auto":  # restarts and requeued jobs: resume if there is a complete checkpoint, else start
        return found[-1] if found else None
    if arg == "latest":
        if not found:
            raise UsageError(
                f"--resume_from_checkpoint latest: no checkpoint in {_checkpoints_dir(output_dir)}"
                " (run without it, or with --checkpoint_every N)"
            )
        return found[-1]
    path = Path(arg)
    if not path.is_dir():
        raise UsageError(f"--resume_from_checkpoint {arg}: no such checkpoint directory")
    return path


def state_digest(state: dict) -> str:
    """sha256 of trainer_state.json's content without its own digest, in one canonical form (keys sorted, after
    a JSON round trip: what was saved and what is read back give the same text)."""
    content = json.loads(json.dumps({k: v for k, v in state.items() if k != STATE_DIGEST_KEY}))
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def read_checkpoint_state(path: Path) -> dict:
    """Read and check a checkpoint's small files before anything is built or written."""
    try:
        state = json.loads((path / STATE_FILE).read_text())
        if not isinstance(state, dict):
            raise TypeError(f"{STATE_FILE} holds no JSON object")
        state_dir = path / "state" / "rank_0" if state.get("per_rank_state") else path / "state"
        dcp.FileSystemReader(str(state_dir)).read_metadata()
        if not (path / "scheduler.pt").is_file():
            raise FileNotFoundError("scheduler.pt")
        for key in ("step", "param_shapes", "global_batch_size"):
            if key not in state:
                raise KeyError(key)
    except Exception as e:  # any failure here means the same thing to the user
        raise UsageError(
            f"--resume_from_checkpoint {path}: not a complete, readable checkpoint "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    # trainer_state.json holds the step and the data position: an edited or damaged one would resume silently
    # at another place (older checkpoints record no digest)
    if STATE_DIGEST_KEY in state and state[STATE_DIGEST_KEY] != state_digest(state):
        what = "is damaged (its content differs from the sha256 recorded in it when it was written)"
        raise UsageError(cannot_resume_line(path, STATE_FILE, what, _step_of(path, state)))
    return state


def _step_of(path: Path, state: dict) -> int:
    """The step a checkpoint holds, from its folder's name (step_<N>) where it has one: its own record may be
    the damaged file."""
    named = re.fullmatch(r"step_(\d+)", path.name)
    return int(named.group(1)) if named else int(state.get("step", 0))


def cannot_resume_line(path: Path, name: str, what: str, step: int) -> str:
    """The line for a checkpoint file that is damaged or gone, naming the way out: an earlier checkpoint, or
    starting over."""
    earlier = [p for p in list_checkpoints(path.parent.parent) if int(p.name.split("_")[1]) < step]
    resume = f"resume from an earlier checkpoint (--resume_from_checkpoint {earlier[-1]}), or " if earlier else ""
    return (
        f"--resume_from_checkpoint {path}: {name} {what}: this checkpoint cannot be resumed; "
        f"{resume}start over (--overwrite_output_dir, or another --output_dir)"
    )


def _file_record(path: Path) -> dict:
    with open(path, "rb") as f:
        return {"bytes": path.stat().st_size, "sha256": hashlib.file_digest(f, "sha256").hexdigest()}


def _on_every_rank(mine: dict) -> dict:
    """The union of every rank's dict (each rank reads its share of the files: the work is spread)."""
    return {k: v for part in gather_object([mine]) for k, v in part.items()}  # Accelerate: all ranks' dicts


def _my_share(names: list[str]) -> list[str]:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return names
    return sorted(names)[torch.distributed.get_rank() :: torch.distributed.get_world_size()]


def record_checkpoint_files(tmp: Path) -> dict:
    """Collective: {relative path: {bytes, sha256}} of every file written (trainer_state.json keeps it)."""
    names = [p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file() and p.name != STATE_FILE]
    return dict(sorted(_on_every_rank({name: _file_record(tmp / name) for name in _my_share(names)}).items()))


def check_checkpoint_files(path: Path, state: dict) -> None:
    """Collective: every file is there, of the size and sha256 recorded when it was written. Every rank
    checks its share, and every rank raises the same line, before anything is loaded."""
    recorded = state.get("files")
    if not recorded:
        return
    found = {}
    for name in _my_share(list(recorded)):
        file = path / name
        if not file.is_file():
            found[name] = "is missing"
        elif file.stat().st_size != recorded[name]["bytes"]:
            found[name] = f"is damaged ({file.stat().st_size:,} bytes, {recorded[name]['bytes']:,} when written)"
        elif _file_record(file)["sha256"] != recorded[name]["sha256"]:
            found[name] = "is damaged (its sha256 differs from the one recorded when it was written)"
    damaged = dict(sorted(_on_every_rank(found).items()))
    if not damaged:
        return
    name, what = next(iter(damaged.items()))
    more = f" (and {len(damaged) - 1} more file{'s' if len(damaged) > 2 else ''})" if len(damaged) > 1 else ""
    raise UsageError(cannot_resume_line(path, name, what + more, _step_of(path, state)))


def check_compatible(state: dict, path: Path, shapes: dict, global_batch_size: int) -> None:
    """The checkpoint's model must be this model (the first difference is named), at the same global batch."""
    saved = state["param_shapes"]
    difference = next(
        (
            f"{name}: {saved.get(name, 'absent')} in the checkpoint, {shapes.get(name, 'absent')} in this model"
            for name in [*shapes, *(n for n in saved if n not in shapes)]
            if saved.get(name) != shapes.get(name)
        ),
        None,
    )
    if difference:
        raise UsageError(
            f"--resume_from_checkpoint {path}: saved by another model (first difference: {difference})"
            ": resume with the model that saved it (the same --model_size and overrides, or the same model config)"
        )
    if state["global_batch_size"] != global_batch_size:
        raise UsageError(
            f"--resume_from_checkpoint {path}: saved with global batch {state['global_batch_size']}"
            f", this run has {global_batch_size}"
            ": keep batch_size x processes x accumulation equal, or give --global_batch_size "
            f"{state['global_batch_size']} (the accumulation then follows the processes)"
        )


def check_same_data_flags(state: dict, path: Path, flags: dict) -> None:
    """The flags that shape what a step trains on must be those the checkpoint was saved with (older
    checkpoints record none of them)."""
    saved = state.get("data_flags", {})
    differ = [name for name, value in flags.items() if name in saved and saved[name] != value]
    if differ:
        now = ", ".join(_as_flag(name, flags[name]) for name in differ)
        was = ", ".join(_as_flag(name, saved[name]) for name in differ)
        raise UsageError(
            f"--resume_from_checkpoint {path}: saved with {was}, this run has {now}: resume with the same "
            "flags (the batches and the model's normalisation follow them), or start over in another --output_dir"
        )


def _data_flags(args, model) -> dict:
    """DATA_FLAGS' values, where the script has the flag (a copy for one's own model may drop them);
    --sync_batchnorm only where the model has BatchNorm (elsewhere it changes nothing)."""
    has_batchnorm = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    return {
        name: getattr(args, name)
        for name in DATA_FLAGS
        if getattr(args, name, None) is not None and (name != "sync_batchnorm" or has_batchnorm)
    }


def _as_flag(name: str, value) -> str:
    if isinstance(value, bool):
        return f"--{name}" if value else f"no --{name}"
    return f"--{name} {value}"


# ---------------------------------------------------------------- the run's lock on its --output_dir
# One run writes to an --output_dir at a time: two would log the same steps twice and publish over each
# other's checkpoints. The main process holds an flock on OUTPUT_DIR/.run.lock (its host and pid inside)
# until it exits: the kernel releases it when the process dies, however it dies, so a lock file that is
# there but not held is a killed run's, taken over.
LOCK_FILE = ".run.lock"
_held_lock: dict = {}  # this process's: {"fd", "path", "made", "pid"} (made: the folder it created, or None)


def lock_output_dir(output_dir) -> str | None:
    """Take the run's lock on `output_dir` (made if missing); a second run is refused in one line, and so is a
    folder that cannot be written. Returns the line to print when a killed run's lock was taken over."""
    out = Path(output_dir)
    made = next((d for d in reversed([out, *out.parents]) if not d.exists()), None)  # the topmost missing folder
    path = out / LOCK_FILE
    try:
        out.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _lock_holder(os.read(fd, 4096))
                os.close(fd)
                raise UsageError(
                    f"--output_dir {out} is in use by another run ({holder}): wait for it to end, or choose another "
                    f"--output_dir (two runs in one folder would write over each other's checkpoints)"
                ) from None
            try:  # the run that held it may have removed the file just before we locked it: lock the one there
                if os.fstat(fd).st_ino == os.stat(path).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        previous = os.read(fd, 4096)
        os.ftruncate(fd, 0)
        record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.pwrite(fd, json.dumps(record).encode(), 0)
    except OSError as e:  # a read-only or full file system, no permission: before step 1, not at the first record
        if made is not None:
            _remove_empty_folders(out, made)
        raise UsageError(
            f"--output_dir {out} cannot be written ({e.strerror or type(e).__name__}): give a writable --output_dir"
        ) from None
    _held_lock.update(fd=fd, path=path, made=made, pid=os.getpid())
    if release_output_dir not in RELEASE_AT_END:  # every exit of run_main, and any other exit of the interpreter
        RELEASE_AT_END.append(release_output_dir)
        atexit.register(release_output_dir)
    if previous.strip():
        return (
            f"--output_dir {out}: taking over the lock of a run that ended without releasing it "
            f"({_lock_holder(previous)}, no longer running)"
        )
    return None


def _lock_holder(content: bytes) -> str:
    try:
        holder = json.loads(content)
        return f"host {holder['host']}, pid {holder['pid']}, started {holder['started']}"
    except (ValueError, TypeError, KeyError):
        return "its holder unknown"


def release_output_dir() -> None:
    """Remove the lock file and let go of the lock; a folder the lock made stays only if the run wrote to it."""
    if not _held_lock or _held_lock["pid"] != os.getpid():  # a forked child's exit leaves its parent's lock
        return
    held = dict(_held_lock)
    _held_lock.clear()
    Path(held["path"]).unlink(missing_ok=True)  # before the lock goes: a run waiting on it then sees no file
    os.close(held["fd"])
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


def check_resume_and_output(
    accelerator, args, model, task, global_batch_size: int, layout=None
) -> tuple[Path | None, dict]:
    """Before anything is written: lock --output_dir for this run, find and check the checkpoint to resume,
    refuse to start a run on top of another, clear it on --overwrite_output_dir. Returns the checkpoint (or
    None) and the facts every checkpoint of this run records besides the tensors (what a resume must match)."""
    facts = {
        "global_batch_size": global_batch_size,
        "world_size": accelerator.num_processes,
        "seed": args.seed,
        "param_shapes": {name: list(p.shape) for name, p in model.named_parameters()},  # before any cut
        "model_config": task.config(),
        "data_flags": _data_flags(args, model),  # what shapes the batches and the normalisation
        **({"layout": layout.describe()} if layout is not None else {}),
    }
    _this_run.clear()  # a run refused below leaves no trial to the next one in this interpreter
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
    resume_path = resolve_checkpoint(args.resume_from_checkpoint, args.output_dir)
    if resume_path:
        state = read_checkpoint_state(resume_path)
        check_checkpoint_files(resume_path, state)
        check_compatible(state, resume_path, facts["param_shapes"], global_batch_size)
        check_same_data_flags(state, resume_path, facts["data_flags"])
        model_dir = Path(args.output_dir) / "model"  # written whole or not at all (export_model)
        if state["step"] > args.max_steps or (state["step"] == args.max_steps and model_dir.is_dir()):
            raise NothingToDo(  # a finished run: change nothing
                f"{resume_path} is already at --max_steps {args.max_steps}: nothing to do "
                "(raise --max_steps to train further)"
            )
        if state["step"] == args.max_steps:  # trained, its export failed (a full disk): the model, from here
            accelerator.print(f"{model_dir} is missing: writing it from {resume_path} (no step to train)")
    # `auto` without a checkpoint starts over: what an earlier attempt wrote before its first
    # checkpoint is replaced, as with --overwrite_output_dir
    overwrite = args.overwrite_output_dir or (args.resume_from_checkpoint == "auto" and resume_path is None)
    out = Path(args.output_dir)
    if ((out / "metrics.jsonl").exists() or _checkpoints_dir(out).exists()) and not resume_path and not overwrite:
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
    will_save = getattr(args, "checkpoint_every", 0) or getattr(args, "stop_at_step", None)
    _this_run.update(output_dir=args.output_dir, facts=facts, trial=bool(will_save))  # load_checkpoint's trial
    return resume_path, facts


def _unwrap_optimizer(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper holds the torch one


def _rng_state() -> dict:
    cuda = {"cuda": torch.cuda.get_rng_state_all()} if torch.cuda.is_available() else {}
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(), **cuda}


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    accelerator,
    args,
    step: int,
    feed,
    model,
    optimizer,
    scheduler,
    facts: dict,
    per_rank_state: bool = False,
    extra_state: dict | None = None,
) -> Path:
    """Collective. Saves the step, the data position and the run's `facts` beside the tensors.
    `per_rank_state`: each rank writes its own replica to state/rank_<r> (Local SGD, between fusions).
    `extra_state`: a strategy's own state, the same on every rank (DiLoCo's outer optimizer).
    BatchNorm's running statistics are averaged over the data-parallel ranks first: one set is saved."""
    average_running_stats(model, feed.dp_group)
    trainer_state, output_dir = {"step": step, **feed.position(), **facts}, args.output_dir
    root = _checkpoints_dir(output_dir)
    final = root / f"step_{trainer_state['step']}"
    tmp = root / f".tmp_step_{trainer_state['step']}"
    saved = (model, optimizer, scheduler, per_rank_state, extra_state)
    write_checkpoint(accelerator, tmp, trainer_state, saved, partial(_save_failed_line, tmp, step))
    if accelerator.is_main_process:
        publish_checkpoint(tmp, final, output_dir, args.keep_last)
    accelerator.wait_for_everyone()
    return final


def write_checkpoint(accelerator, tmp: Path, trainer_state: dict, saved: tuple, failed_line, any_error=False) -> None:
    """Collective: `saved` (model, optimizer, scheduler, per_rank_state, extra_state) as a checkpoint in `tmp`.
    A write that fails (a full disk; with `any_error`, any error) is noted and the save goes on to the next point
    where every rank compares notes (_all_written): every rank stops with `failed_line(reason, refused)`."""
    model, optimizer, scheduler, per_rank_state, extra_state = saved
    failed = None
    if accelerator.is_main_process:
        with _noting_write_failure(tmp, any_error) as failed:
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of an interrupted save
            (tmp / "rng").mkdir(parents=True)
    _all_written(accelerator, failed, tmp, failed_line)
    model_sd, optim_sd = get_state_dict(model, _unwrap_optimizer(optimizer), options=OPTIONS)
    state_dir = tmp / "state" / f"rank_{accelerator.process_index}" if per_rank_state else tmp / "state"
    with _noting_write_failure(tmp, any_error) as failed:
        with _each_rank_alone(per_rank_state):
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(state_dir), no_dist=per_rank_state)
        torch.save(_rng_state(), tmp / "rng" / f"rank_{accelerator.process_index}.pt")
        if accelerator.is_main_process:
            torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
            if extra_state is not None:  # inside the checkpoint before it is published: whole or not at all
                torch.save(extra_state, tmp / EXTRA_STATE_FILE)
    _all_written(accelerator, failed, tmp, failed_line)  # every rank's files are written (DCP wrote its metadata last)
    files = record_checkpoint_files(tmp)  # what a resume checks first: every file, its size and digest
    failed = None
    if accelerator.is_main_process:
        with _noting_write_failure(tmp, any_error) as failed:
            state = {**trainer_state, "per_rank_state": per_rank_state, "files": files}
            state[STATE_DIGEST_KEY] = state_digest(state)  # the file covers itself too: a resume checks it first
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
    _all_written(accelerator, failed, tmp, failed_line)


# errno of a write the file system refused: full, over quota, read-only, no permission, an I/O error
WRITE_FAILURES = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO, errno.EFBIG}


class _WriteFailure:
    reason: str | None = None  # why a write failed, for the line
    refused: bool = True  # the file system refused it (full, read-only...); False: another error (any_error)


@contextmanager
def _noting_write_failure(folder: Path, any_error: bool = False):
    """Keep why a write into `folder` failed in the yielded note instead of raising (a lost peer is raised);
    `any_error`: any other error too, as "Type: message"."""
    note = _WriteFailure()
    try:
        yield note
    except (Exception, CheckpointException) as e:  # DCP gathers every rank's failure in a CheckpointException
        note.reason = _write_failure(e, folder)
        if note.reason is None and any_error and not isinstance(e, torch.distributed.DistBackendError):
            first = next(iter(e.failures.values()), e) if isinstance(e, CheckpointException) else e  # a rank's
            note.reason, note.refused = _error_line(first[0] if isinstance(first, tuple) else first), False
        if note.reason is None:
            raise


def _error_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}".rstrip(": ")


def _write_failure(error: BaseException, folder: Path) -> str | None:
    """Why a write was refused, if that is what `error` is (in DCP's gathered failures, or its causes), or None."""
    seen, todo = [], [error]
    while todo:
        e = todo.pop(0)
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        if isinstance(e, OSError) and e.errno in WRITE_FAILURES:
            return e.strerror
        code = re.search(r"\(os error (\d+)\)", str(e))  # safetensors' writer: "I/O error: ... (os error 28)"
        if code and int(code.group(1)) in WRITE_FAILURES:
            return os.strerror(int(code.group(1)))
        if isinstance(e, RuntimeError) and "inline_container" in str(e):  # torch.save's writer names no errno
            full = shutil.disk_usage(next(d for d in [folder, *folder.parents] if d.exists())).free < 2**20
            return os.strerror(errno.ENOSPC) if full else f"torch.save failed: {str(e).splitlines()[0][:120]}"
        if isinstance(e, CheckpointException):
            todo += [failure[0] for failure in e.failures.values()]
        todo += [e.__cause__, e.__context__]
    return None


def _all_written(accelerator, note: _WriteFailure | None, tmp: Path, failed_line) -> None:
    """Collective: every rank learns whether any failed to write; if one did, the partial save is removed
    and every rank stops with one line, `failed_line(reason, refused)` of the first failure (the checkpoints
    published before are whole)."""
    mine = None if note is None or note.reason is None else (note.reason, note.refused)
    failures = [f for f in gather_object([mine]) if f]
    if not failures:
        return
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    raise UsageError(failed_line(*failures[0]))


def _save_failed_line(tmp: Path, step: int, reason: str, refused: bool = True) -> str:
    earlier = list_checkpoints(tmp.parent.parent)
    then = (
        f"continue from the last complete checkpoint ({earlier[-1]}) with --resume_from_checkpoint latest"
        if earlier
        else "run again"
    )
    return (
        f"the checkpoint of step {step} could not be written to {tmp.parent} ({reason}); its partial save "
        f"is removed: free space there (--keep_last N keeps fewer checkpoints), then {then}"
    )


@contextmanager
def _each_rank_alone(per_rank_state: bool):
    """Per-rank state (Local SGD) is saved without collectives (`no_dist=True`), on purpose: DCP's warning
    that it assumes "a single process" is wrong here, and only it is silenced."""
    with warnings.catch_warnings():
        if per_rank_state:
            warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled, )?unavailable or uninit")
        yield


def publish_checkpoint(tmp: Path, final: Path, output_dir, keep_last: int) -> None:
    """Main process: rename a complete save into place, then delete what it replaces (--keep_last)."""
    replaced = final.with_name(f".old_{final.name}")
    if final.exists():  # the same step saved before (a run resumed from an older checkpoint)
        os.replace(final, replaced)
    os.replace(tmp, final)  # the checkpoint appears whole or not at all
    shutil.rmtree(replaced, ignore_errors=True)
    if keep_last > 0:  # only now that the new one is complete
        for old in list_checkpoints(output_dir)[:-keep_last]:
            shutil.rmtree(old)
    for leftover in final.parent.glob(".tmp_step_*"):  # saves that a kill interrupted
        shutil.rmtree(leftover, ignore_errors=True)


def load_checkpoint(accelerator, path: Path | None, model, optimizer, scheduler, replicas: bool = False) -> dict:
    """Collective: restores model, optimizer, scheduler and RNG in place; returns where the run stands
    (no path: step 0). A checkpoint of replicas saved between fusions (Local SGD) gives each rank its own
    (`replicas`: the caller keeps them apart), or, to any other strategy, rank 0's on every rank: one model.
    Then, in a run that will save checkpoints (check_resume_and_output said so), a trial checkpoint: the run's
    own save and this load, once before step 1 (trial_checkpoint)."""
    progress = _restore(accelerator, path, model, optimizer, scheduler, replicas)
    run = dict(_this_run)
    _this_run.clear()  # once per run
    if run.get("trial"):
        from .trial import trial_checkpoint  # imported only by a run that will save checkpoints

        trial_checkpoint(accelerator, run, model, optimizer, scheduler, progress["step"], replicas)
    return progress


def _restore(accelerator, path: Path | None, model, optimizer, scheduler, replicas: bool) -> dict:
    if path is None:
        return {"step": 0, "epoch": 0, "samples_in_epoch": 0}
    state = json.loads((path / STATE_FILE).read_text())
    model_sd, optim_sd = get_state_dict(model, _unwrap_optimizer(optimizer), options=OPTIONS)
    to_load = {"model": model_sd, "optim": optim_sd}
    per_rank = state.get("per_rank_state", False)
    saved_rank = accelerator.process_index % state.get("world_size", accelerator.num_processes)  # elastic: r mod N
    if per_rank and not replicas:  # one model on every rank and layout, not N replicas DDP would keep apart
        saved_rank = 0
        accelerator.print(
            f"resuming {path.name}: it holds {state.get('world_size')} Local SGD replicas saved between fusions; "
            "every rank starts from replica 0's model and optimizer state"
        )
    state_dir = path / "state" / f"rank_{saved_rank}" if per_rank else path / "state"
    try:
        with _each_rank_alone(per_rank):
            dcp.load(to_load, checkpoint_id=str(state_dir), no_dist=per_rank)  # errors are gathered: every rank raises
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise UsageError(
            f"--resume_from_checkpoint {path}: the model/optimizer state cannot be read"
            f" ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); the checkpoint is damaged"
        ) from None
    model_sd, optim_sd = to_load["model"], to_load["optim"]  # what DCP loaded (it may replace non-tensor values)
    set_state_dict(
        model, _unwrap_optimizer(optimizer), model_state_dict=model_sd, optim_state_dict=optim_sd, options=OPTIONS
    )
    scheduler.load_state_dict(_load_small_file(path, "scheduler.pt", weights_only=False))
    # Another layout may group the parameters differently (one optimizer group per kind of
    # parameter): every group follows the same schedule from the same peak, so resize the lists.
    schedule = getattr(scheduler, "scheduler", scheduler)  # Accelerate's wrapper holds the torch one
    n_groups = len(_unwrap_optimizer(optimizer).param_groups)
    schedule.base_lrs = schedule.base_lrs[:1] * n_groups
    schedule._last_lr = schedule._last_lr[:1] * n_groups
    rng_file = path / "rng" / f"rank_{accelerator.process_index}.pt"
    if state.get("world_size") == accelerator.num_processes and rng_file.is_file():
        _set_rng_state(_load_small_file(path, rng_file.relative_to(path).as_posix(), weights_only=False))
    else:  # another layout: per-rank streams cannot map one to one; reseed deterministically
        torch.manual_seed(state.get("seed", 0) + state["step"] * 1000 + accelerator.process_index)
    return state


# ---------------------------------------------------------------- the trial checkpoint, before step 1
# A checkpoint that cannot be written (a disk too small, no permission) or read back (a state torch cannot save,
# a load that cannot read what was saved) would fail at the first save, after training; tried once before step 1,
# it fails there, in one line, with nothing trained.
_this_run: dict = {}  # check_resume_and_output's {"output_dir", "facts", "trial"}, for load_checkpoint


def _free_space(folder: Path) -> str:
    free = shutil.disk_usage(next(d for d in [folder, *folder.parents] if d.exists())).free
    return f"{free:,} bytes" if free < 2**20 else f"{free / 2**20:,.1f} MiB"


def load_extra_state(path: Path | None) -> dict | None:
    """The `extra_state` save_checkpoint wrote at `path` (None: none)."""
    if path is None or not (path / EXTRA_STATE_FILE).is_file():
        return None
    return _load_small_file(path, EXTRA_STATE_FILE, weights_only=True)


def _load_small_file(path: Path, name: str, weights_only: bool):
    """torch.load of a checkpoint file; a damaged one (older checkpoints record no digests) is one line."""
    try:
        return torch.load(path / name, weights_only=weights_only)
    except Exception as e:
        raise UsageError(
            f"--resume_from_checkpoint {path}: {name} cannot be read ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200] if str(e) else ''}); the checkpoint is damaged: resume from an earlier "
            "checkpoint, or start over (--overwrite_output_dir)"
        ) from None


def export_model(accelerator, model, task, data_source: dict, model_dir, layout=None) -> None:
    """Collective: write `model/` the task's way (Task.export), from the main process, into a folder beside it
    renamed into place once whole. Under pipeline parallelism one rank per stage sends its stage's tensors.
    BatchNorm's running statistics are averaged first: the export is the model the run evaluated. A write that
    fails (a full disk) removes what it wrote and is one line on every rank, naming the checkpoint to resume."""
    average_running_stats(model, layout.group("dp") if layout is not None else None)
    if layout is None or layout.pp == 1:
        full_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        # collective within the stage
        stage_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        part = {k: v.cpu() for k, v in stage_sd.items()} if layout.writes_stage else {}
        parts = [None] * layout.world_size if accelerator.is_main_process else None
        torch.distributed.gather_object(part, parts, dst=0)
        full_sd = {k: v for p in parts for k, v in p.items()} if accelerator.is_main_process else {}
    failed = _write_model(task, full_sd, Path(model_dir), data_source) if accelerator.is_main_process else None
    failed = gather_object([failed])[0]  # every rank learns the main process's outcome (and waits for it)
    if failed:
        raise UsageError(failed)


def _write_model(task, full_sd: dict, model_dir: Path, data_source: dict) -> str | None:
    """Main process: Task.export into OUTPUT_DIR/.export_model, renamed to model_dir once whole; a failure
    removes what it wrote (a model/ of an earlier run stays as it was) and returns the line."""
    tmp, replaced = model_dir.with_name(f".export_{model_dir.name}"), model_dir.with_name(f".old_{model_dir.name}")
    written = (tmp, tmp.with_name(f".tmp_{tmp.name}"))  # and Task.export's own temporary folder (write_model_dir)
    try:
        for folder in (*written, replaced):
            shutil.rmtree(folder, ignore_errors=True)  # leftovers of an export a kill interrupted
        tmp.mkdir(parents=True)
        task.export(full_sd, tmp, data_source)
        record_task(task, tmp)
        if model_dir.exists():  # a model of an earlier --max_steps (a resumed run)
            os.replace(model_dir, replaced)
        os.replace(tmp, model_dir)  # the model appears whole or not at all
        shutil.rmtree(replaced, ignore_errors=True)
        return None
    except Exception as e:
        for folder in written:
            shutil.rmtree(folder, ignore_errors=True)
        if replaced.exists() and not model_dir.exists():
            os.replace(replaced, model_dir)
        refused, kept = _write_failure(e, tmp), list_checkpoints(model_dir.parent)
        size = sum(v.numel() * v.element_size() for v in full_sd.values() if isinstance(v, torch.Tensor)) / 2**20
        why = f"{refused}; {_free_space(model_dir)} free there, {size:,.1f} MiB of weights to write" if refused else ""
        why, fix = why or f"Task.export raised {_error_line(e)}", "free space there, or give another --output_dir"
        fix = fix if refused else "fix Task.export in the script's MODEL section (docs/your-model.md)"
        then = "then run again (no checkpoint was kept to resume: --checkpoint_every N keeps them)"
        if kept:
            then = f"then --resume_from_checkpoint latest resumes from {kept[-1]} and writes the model (from another "
            then += f"--output_dir: --resume_from_checkpoint {kept[-1]})"
        return (
            f"the final model could not be written to {model_dir} ({why}): its partial files are removed; {fix}, {then}"
        )


def record_task(task, model_dir) -> None:
    """model/task.json: where a Task of the user's own lives, so evaluate.py rebuilds the model without
    --task (not for common/'s Tasks, nor a class defined inside a function)."""
    model_dir = Path(model_dir)
    cls = type(task)
    try:
        source = Path(inspect.getsourcefile(cls)).resolve()
    except (TypeError, OSError):
        source = None
    (model_dir / TASK_FILE).unlink(missing_ok=True)  # a custom export may reuse the folder of another model
    if source is None or source.parent == Path(__file__).resolve().parent or "<locals>" in cls.__qualname__:
        return
    (model_dir / TASK_FILE).write_text(json.dumps({"file": str(source), "class": cls.__qualname__}, indent=1) + "\n")
