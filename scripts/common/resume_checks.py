"""What a resume checks before anything is built (output_checks.check_resume_and_output, on a resumed run):
the checkpoint's small files, every file's size and sha256 against trainer_state.json's record,
trainer_state.json against its own digest, the model (parameter names and shapes), global batch and data
flags it was saved with; a run already at --max_steps is nothing to do. And the trial checkpoint before
step 1 (output_checks.trial_checkpoint, in a run that will save): the run's own save, read back as a resume
reads it, removed, so a checkpoint that cannot be written or read back fails there, with nothing trained."""

from __future__ import annotations

import json
import re
import shutil
import warnings
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader

from .checkpoint_format import (
    STATE_DIGEST_KEY,
    STATE_FILE,
    file_record,
    list_checkpoints,
    my_share,
    on_every_rank,
    rng_state,
    set_rng_state,
    state_digest,
    unwrap_optimizer,
)
from .errors import NothingToDo, UsageError


def read_checkpoint_state(path: Path) -> dict:
    """Read and check a checkpoint's small files before anything is built or written."""
    try:
        state = json.loads((path / STATE_FILE).read_text())
        if not isinstance(state, dict):
            raise TypeError(f"{STATE_FILE} holds no JSON object")
        state_dir = path / "state" / "rank_0" if state.get("per_rank_state") else path / "state"
        FileSystemReader(str(state_dir)).read_metadata()
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


def check_checkpoint_files(path: Path, state: dict) -> None:
    """Collective: every file is there, of the size and sha256 recorded when it was written. Every rank
    checks its share, and every rank raises the same line, before anything is loaded."""
    recorded = state.get("files")
    if not recorded:
        return
    found = {}
    for name in my_share(list(recorded)):
        file = path / name
        if not file.is_file():
            found[name] = "is missing"
        elif file.stat().st_size != recorded[name]["bytes"]:
            found[name] = f"is damaged ({file.stat().st_size:,} bytes, {recorded[name]['bytes']:,} when written)"
        elif file_record(file)["sha256"] != recorded[name]["sha256"]:
            found[name] = "is damaged (its sha256 differs from the one recorded when it was written)"
    damaged = dict(sorted(on_every_rank(found).items()))
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


def _as_flag(name: str, value) -> str:
    if isinstance(value, bool):
        return f"--{name}" if value else f"no --{name}"
    return f"--{name} {value}"


def check_resumable(accelerator, args, path: Path, facts: dict) -> None:
    """Before anything is written: the checkpoint's small files, every file against its record, and the
    model, global batch and data flags it was saved with against this run's `facts`; a run already at
    --max_steps is nothing to do."""
    state = read_checkpoint_state(path)
    check_checkpoint_files(path, state)
    check_compatible(state, path, facts["param_shapes"], facts["global_batch_size"])
    check_same_data_flags(state, path, facts["data_flags"])
    model_dir = Path(args.output_dir) / "model"  # written whole or not at all (export_model)
    if state["step"] > args.max_steps or (state["step"] == args.max_steps and model_dir.is_dir()):
        done = f"{path} is already at --max_steps {args.max_steps}: nothing to do"
        raise NothingToDo(f"{done} (raise --max_steps to train further)")  # a finished run: change nothing
    if state["step"] == args.max_steps:  # trained, its export failed (a full disk): the model, from here
        accelerator.print(f"{model_dir} is missing: writing it from {path} (no step to train)")


# ---------------------------------------------------------------- the trial checkpoint, before step 1
# A checkpoint that cannot be written (a disk too small, no permission) or read back (a state torch cannot save,
# a load that cannot read what was saved) would fail at the first save, after training; tried once before step 1,
# it fails there, in one line, with nothing trained.
TRIAL_DIR = ".trial_checkpoint"  # OUTPUT_DIR/.trial_checkpoint: beside checkpoints/, on the same file system


def try_checkpoint(accelerator, output_dir, facts: dict, model, optimizer, scheduler, per_rank_state: bool) -> None:
    """Collective (output_checks.trial_checkpoint): the run's own save (write_checkpoint: every rank writes its
    part) into OUTPUT_DIR/.trial_checkpoint, then what a resume does with it (its integrity check, its load),
    then the folder removed. It changes nothing: what it loads is what it saved, and the RNG is put back. A
    fresh run's optimizer has no state yet: it is saved without one (torch would fill it with an optimizer step
    of zero gradients, running the optimizer's hooks)."""
    from .checkpoint_resume import restore  # the load of a resume
    from .checkpoint_save import write_checkpoint  # the run's own save

    folder = Path(output_dir) / TRIAL_DIR
    rng, agreed = rng_state(), False
    try:
        with _no_state_filled_in(optimizer), warnings.catch_warnings():
            # one process: DCP's warning that it assumes "a single process" is right, and not the run's to print
            warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled, )?unavailable or uninit")
            saved, failed_line = (model, optimizer, scheduler, per_rank_state, None), partial(_trial_line, folder)
            write_checkpoint(accelerator, folder, {"step": 0, **facts}, saved, failed_line, any_error=True)
            try:
                check_checkpoint_files(folder, read_checkpoint_state(folder))  # the integrity check of a resume
                restore(accelerator, folder, model, optimizer, scheduler, per_rank_state)  # the load of a resume
            except UsageError as e:  # the resume's line about the trial folder: what failed in it
                what = str(e).removeprefix(f"--resume_from_checkpoint {folder}: ")
                what = re.split(r": this checkpoint cannot be resumed|; the checkpoint is damaged", what)[0]
                raise UsageError(_trial_line(folder, what, None)) from None
        agreed = True
    except UsageError:  # every rank raises the same line (the notes and DCP's failures are gathered)
        agreed = True
        raise
    finally:
        if agreed:
            accelerator.wait_for_everyone()  # no rank still reads it
        if accelerator.is_main_process:
            shutil.rmtree(folder, ignore_errors=True)
        set_rng_state(rng)


@contextmanager
def _no_state_filled_in(optimizer):
    """An optimizer without state: a zero gradient on one parameter while it is saved and loaded, so that torch's
    get_state_dict/set_state_dict leave it without state instead of taking a step to fill it in."""
    torch_optimizer = unwrap_optimizer(optimizer)
    params = [p for group in torch_optimizer.param_groups for p in group["params"] if p.requires_grad]
    empty = not torch_optimizer.state and params and all(p.grad is None for p in params)
    if empty:
        params[0].grad = torch.zeros_like(params[0])
    try:
        yield
    finally:
        if empty:
            params[0].grad = None


def _trial_line(folder: Path, reason: str, refused: bool | None) -> str:
    """refused: the file system refused a write; False: the save failed otherwise; None: it cannot be read back."""
    if refused:
        from .checkpoint_save import free_space

        failed = f"could not be written to {folder} ({reason}; {free_space(folder)} free there)"
        fix = "free space there, or give another --output_dir"
    else:
        failed = f"could not be saved ({reason})" if refused is False else f"cannot be read back ({reason})"
        fix = "keep what the model, the optimizer and the LR scheduler hold savable (docs/troubleshooting.md)"
    return (
        f"a trial checkpoint before step 1 {failed}: the run's checkpoints would fail so, after training; nothing is "
        f"trained: {fix}, or train without checkpoints (--checkpoint_every 0, no --stop_at_step)"
    )
