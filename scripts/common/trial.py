"""The trial checkpoint before step 1 (load_checkpoint runs it in a run that will save checkpoints): a
checkpoint that cannot be written (a disk too small, no permission) or read back (a state torch cannot save, a
load that cannot read what was saved) would fail at the first save, after training; tried once before step 1,
it fails there, in one line, with nothing trained. Imported only by a run that saves."""

from __future__ import annotations

import re
import shutil
import warnings
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch

from .checkpoint import (
    _free_space,
    _restore,
    _rng_state,
    _set_rng_state,
    _unwrap_optimizer,
    check_checkpoint_files,
    read_checkpoint_state,
    write_checkpoint,
)
from .errors import UsageError

TRIAL_DIR = ".trial_checkpoint"  # OUTPUT_DIR/.trial_checkpoint: beside checkpoints/, on the same file system


def trial_checkpoint(accelerator, run: dict, model, optimizer, scheduler, step: int, per_rank_state: bool) -> None:
    """Collective: the run's own save (write_checkpoint: every rank writes its part) into OUTPUT_DIR/.trial_checkpoint,
    then what a resume does with it (its integrity check, its load), then the folder removed. It changes nothing:
    what it loads is what it saved, and the RNG is put back. A fresh run's optimizer has no state yet: it is saved
    without one (torch would fill it with an optimizer step of zero gradients, running the optimizer's hooks)."""
    folder = Path(run["output_dir"]) / TRIAL_DIR
    rng, agreed = _rng_state(), False
    try:
        with _no_state_filled_in(optimizer), warnings.catch_warnings():
            # one process: DCP's warning that it assumes "a single process" is right, and not the run's to print
            warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled, )?unavailable or uninit")
            saved, failed_line = (model, optimizer, scheduler, per_rank_state, None), partial(_trial_line, folder)
            write_checkpoint(accelerator, folder, {"step": step, **run["facts"]}, saved, failed_line, any_error=True)
            try:
                check_checkpoint_files(folder, read_checkpoint_state(folder))  # the integrity check of a resume
                _restore(accelerator, folder, model, optimizer, scheduler, per_rank_state)  # the load of a resume
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
        _set_rng_state(rng)


@contextmanager
def _no_state_filled_in(optimizer):
    """An optimizer without state: a zero gradient on one parameter while it is saved and loaded, so that torch's
    get_state_dict/set_state_dict leave it without state instead of taking a step to fill it in."""
    torch_optimizer = _unwrap_optimizer(optimizer)
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
        failed = f"could not be written to {folder} ({reason}; {_free_space(folder)} free there)"
        fix = "free space there, or give another --output_dir"
    else:
        failed = f"could not be saved ({reason})" if refused is False else f"cannot be read back ({reason})"
        fix = "keep what the model, the optimizer and the LR scheduler hold savable (docs/troubleshooting.md)"
    return (
        f"a trial checkpoint before step 1 {failed}: the run's checkpoints would fail so, after training; nothing is "
        f"trained: {fix}, or train without checkpoints (--checkpoint_every 0, no --stop_at_step)"
    )
