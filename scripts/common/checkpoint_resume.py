"""What a checkpoint holds and how a resume reads it (common/checkpoint.py's docstring shows the folder):
its small files checked before anything is built (every file's size and sha256, trainer_state.json's own
digest), the model it must be (parameter names and shapes, the global batch, the data flags), and the load
of the model, optimizer, LR schedule and every rank's RNG. Imported by a run that resumes, and by one that
saves (its trial checkpoint is read back as a resume reads it: common/checkpoint_save.py)."""

from __future__ import annotations

import hashlib
import json
import random
import re
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from accelerate.utils import gather_object
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from .checkpoint import list_checkpoints
from .errors import NothingToDo, UsageError

STATE_FILE = "trainer_state.json"
STATE_DIGEST_KEY = "state_sha256"  # in trainer_state.json: the sha256 of the rest of it (state_digest)
EXTRA_STATE_FILE = "extra_state.pt"  # a strategy's own state (save_checkpoint(extra_state=...))
# Optimizer state keyed by parameter name ("optim.state.blocks.3.mlp.up_proj.weight.exp_avg"),
# not by position in a param group: pipeline stages hold different parameters in "the same"
# groups, and another layout must find each parameter's state by its name.
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# LoRA: a checkpoint holds the adapters and their optimizer state; the frozen base comes from its source again
ADAPTERS_ONLY = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True, strict=False)


def options_for(model) -> StateDictOptions:
    """What a checkpoint of this model holds: every parameter, or under LoRA the adapters only."""
    return ADAPTERS_ONLY if any(".lora_A." in n for n, _ in model.named_parameters()) else OPTIONS


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


@contextmanager
def _each_rank_alone(per_rank_state: bool):
    """Per-rank state (Local SGD) is saved without collectives (`no_dist=True`), on purpose: DCP's warning
    that it assumes "a single process" is wrong here, and only it is silenced."""
    with warnings.catch_warnings():
        if per_rank_state:
            warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled, )?unavailable or uninit")
        yield


def restore(accelerator, path: Path, model, optimizer, scheduler, replicas: bool) -> dict:
    """Collective: model, optimizer, scheduler and RNG restored in place from `path`; returns its trainer
    state. `replicas`: a checkpoint of Local SGD replicas gives each rank its own (load_checkpoint)."""
    state = json.loads((path / STATE_FILE).read_text())
    options = options_for(model)
    model_sd, optim_sd = get_state_dict(model, _unwrap_optimizer(optimizer), options=options)
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
        model, _unwrap_optimizer(optimizer), model_state_dict=model_sd, optim_state_dict=optim_sd, options=options
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
