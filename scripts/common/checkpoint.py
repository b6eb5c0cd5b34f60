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

This module is what every run does (the lock, the checks before step 1, the export); the writing of a
checkpoint and its trial are common/checkpoint_save.py's, the reading of one common/checkpoint_resume.py's,
each imported only by a run that saves, or resumes.
"""

from __future__ import annotations

import atexit
import fcntl
import inspect
import json
import os
import re
import shutil
import socket
import time
from pathlib import Path

import torch
from accelerate.utils import gather_object
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from .batchnorm import average_running_stats
from .errors import RELEASE_AT_END, UsageError

TASK_FILE = "task.json"  # in model/: where a Task of the user's own lives (evaluate.py rebuilds the model with it)
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


def _data_flags(args, model) -> dict:
    """DATA_FLAGS' values, where the script has the flag (a copy for one's own model may drop them);
    --sync_batchnorm only where the model has BatchNorm (elsewhere it changes nothing)."""
    has_batchnorm = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    return {
        name: getattr(args, name)
        for name in DATA_FLAGS
        if getattr(args, name, None) is not None and (name != "sync_batchnorm" or has_batchnorm)
    }


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
        from .checkpoint_resume import check_resumable  # only a resumed run reads a checkpoint

        check_resumable(accelerator, args, resume_path, facts)
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


# The trial checkpoint before step 1 (common/checkpoint_save.py): a checkpoint that cannot be written (a disk too
# small, no permission) or read back would fail at the first save, after training; tried once before step 1, it
# fails there, in one line, with nothing trained.
_this_run: dict = {}  # check_resume_and_output's {"output_dir", "facts", "trial"}, for load_checkpoint


def load_checkpoint(accelerator, path: Path | None, model, optimizer, scheduler, replicas: bool = False) -> dict:
    """Collective: restores model, optimizer, scheduler and RNG in place; returns where the run stands
    (no path: step 0). A checkpoint of replicas saved between fusions (Local SGD) gives each rank its own
    (`replicas`: the caller keeps them apart), or, to any other strategy, rank 0's on every rank: one model.
    Then, in a run that will save checkpoints (check_resume_and_output said so), a trial checkpoint: the run's
    own save and this load, once before step 1 (trial_checkpoint)."""
    progress = {"step": 0, "epoch": 0, "samples_in_epoch": 0}
    if path is not None:
        from .checkpoint_resume import restore  # only a resumed run reads a checkpoint

        progress = restore(accelerator, path, model, optimizer, scheduler, replicas)
    run = dict(_this_run)
    _this_run.clear()  # once per run
    if run.get("trial"):
        from .checkpoint_save import trial_checkpoint  # only a run that will save checkpoints tries one

        trial_checkpoint(accelerator, run, model, optimizer, scheduler, progress["step"], replicas)
    return progress


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
    BatchNorm's running statistics are averaged over the data-parallel ranks first: one set is saved.
    Returns the checkpoint's folder (the writing: common/checkpoint_save.py)."""
    from .checkpoint_save import save  # only a run that saves checkpoints writes one

    saved = (model, optimizer, scheduler, per_rank_state, extra_state)
    return save(accelerator, args, step, feed, saved, facts)


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
    failed = None
    if accelerator.is_main_process and getattr(task, "lora", None):  # LoRA: the adapter as PEFT saves it
        from .lora import export_lora

        try:
            export_lora(task, full_sd, Path(model_dir).parent, data_source, _write_model)
        except UsageError as e:
            failed = str(e)
    elif accelerator.is_main_process:
        failed = _write_model(task, full_sd, Path(model_dir), data_source)
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
        from .checkpoint_save import export_failed_line  # only a failed export explains itself

        return export_failed_line(e, model_dir, full_sd)


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
