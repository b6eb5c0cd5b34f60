"""Reading a checkpoint back (common/checkpoint.py's load_checkpoint, on a resume): the model, optimizer, LR
schedule and every rank's RNG restored in place, and a strategy's own state (load_extra_state). What the
folder holds: common/checkpoint_format.py; the checks a resume passes first: common/resume_checks.py.
Imported by a run that resumes, and by the trial checkpoint of one that saves."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from .checkpoint_format import (
    EXTRA_STATE_FILE,
    STATE_FILE,
    each_rank_alone,
    options_for,
    set_rng_state,
    unwrap_optimizer,
)
from .errors import UsageError


def restore(accelerator, path: Path, model, optimizer, scheduler, replicas: bool) -> dict:
    """Collective: model, optimizer, scheduler and RNG restored in place from `path`; returns its trainer
    state. `replicas`: a checkpoint of Local SGD replicas gives each rank its own (load_checkpoint)."""
    state = json.loads((path / STATE_FILE).read_text())
    options = options_for(model)
    model_sd, optim_sd = get_state_dict(model, unwrap_optimizer(optimizer), options=options)
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
        with each_rank_alone(per_rank):
            dcp.load(to_load, checkpoint_id=str(state_dir), no_dist=per_rank)  # errors are gathered: every rank raises
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise UsageError(
            f"--resume_from_checkpoint {path}: the model/optimizer state cannot be read"
            f" ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); the checkpoint is damaged"
        ) from None
    model_sd, optim_sd = to_load["model"], to_load["optim"]  # what DCP loaded (it may replace non-tensor values)
    set_state_dict(
        model, unwrap_optimizer(optimizer), model_state_dict=model_sd, optim_state_dict=optim_sd, options=options
    )
    scheduler.load_state_dict(_load_small_file(path, "scheduler.pt", weights_only=False))
    # Another layout may group the parameters differently (one optimizer group per kind of
    # parameter): every group follows the same schedule from the same peak, so resize the lists.
    schedule = getattr(scheduler, "scheduler", scheduler)  # Accelerate's wrapper holds the torch one
    n_groups = len(unwrap_optimizer(optimizer).param_groups)
    schedule.base_lrs = schedule.base_lrs[:1] * n_groups
    schedule._last_lr = schedule._last_lr[:1] * n_groups
    rng_file = path / "rng" / f"rank_{accelerator.process_index}.pt"
    if state.get("world_size") == accelerator.num_processes and rng_file.is_file():
        set_rng_state(_load_small_file(path, rng_file.relative_to(path).as_posix(), weights_only=False))
    else:  # another layout: per-rank streams cannot map one to one; reseed deterministically
        torch.manual_seed(state.get("seed", 0) + state["step"] * 1000 + accelerator.process_index)
    return state


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
