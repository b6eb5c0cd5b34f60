"""Writing a checkpoint (common/checkpoint.py's save_checkpoint): into `checkpoints/.tmp_step_<N>`,
renamed once complete, so a kill at any moment leaves the previous checkpoint; a save that fails
(a full disk) removes it and is one line on every rank. And the line for an export of `model/`
that failed. Imported only by a run that saves checkpoints (and by its trial checkpoint before
step 1: common/resume_checks.py), or whose export failed."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from accelerate.utils import gather_object
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict

from .batchnorm import average_running_stats
from .checkpoint_format import (
    EXTRA_STATE_FILE,
    STATE_DIGEST_KEY,
    STATE_FILE,
    checkpoints_dir,
    each_rank_alone,
    list_checkpoints,
    options_for,
    record_checkpoint_files,
    rng_state,
    state_digest,
    unwrap_optimizer,
)
from .errors import UsageError


def save(accelerator, args, step: int, feed, saved: tuple, facts: dict) -> Path:
    """common/checkpoint.py's save_checkpoint of `saved` (model, optimizer, scheduler, per_rank_state,
    extra_state): into checkpoints/.tmp_step_<N>, published once whole."""
    average_running_stats(saved[0], feed.dp_group)
    trainer_state, output_dir = {"step": step, **feed.position(), **facts}, args.output_dir
    root = checkpoints_dir(output_dir)
    final = root / f"step_{trainer_state['step']}"
    tmp = root / f".tmp_step_{trainer_state['step']}"
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
    model_sd, optim_sd = get_state_dict(model, unwrap_optimizer(optimizer), options=options_for(model))
    state_dir = tmp / "state" / f"rank_{accelerator.process_index}" if per_rank_state else tmp / "state"
    with _noting_write_failure(tmp, any_error) as failed:
        with each_rank_alone(per_rank_state):
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(state_dir), no_dist=per_rank_state)
        torch.save(rng_state(), tmp / "rng" / f"rank_{accelerator.process_index}.pt")
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


def free_space(folder: Path) -> str:
    free = shutil.disk_usage(next(d for d in [folder, *folder.parents] if d.exists())).free
    return f"{free:,} bytes" if free < 2**20 else f"{free / 2**20:,.1f} MiB"


def export_failed_line(error: Exception, model_dir: Path, full_sd: dict) -> str:
    """The line for an export of `model/` that failed (common/checkpoint.py's export_model): why, the space
    there where the file system refused it, and the way out (the checkpoint to resume from, if one is kept)."""
    tmp = model_dir.with_name(f".export_{model_dir.name}")  # where Task.export wrote (export_model)
    refused, kept = _write_failure(error, tmp), list_checkpoints(model_dir.parent)
    size = sum(v.numel() * v.element_size() for v in full_sd.values() if isinstance(v, torch.Tensor)) / 2**20
    why = f"{refused}; {free_space(model_dir)} free there, {size:,.1f} MiB of weights to write" if refused else ""
    why, fix = why or f"Task.export raised {_error_line(error)}", "free space there, or give another --output_dir"
    fix = fix if refused else "fix Task.export in the script's MODEL section (docs/your-model.md)"
    then = "then run again (no checkpoint was kept to resume: --checkpoint_every N keeps them)"
    if kept:
        then = f"then --resume_from_checkpoint latest resumes from {kept[-1]} and writes the model (from another "
        then += f"--output_dir: --resume_from_checkpoint {kept[-1]})"
    failed = f"the final model could not be written to {model_dir} ({why}): its partial files are removed"
    return f"{failed}; {fix}, {then}"
