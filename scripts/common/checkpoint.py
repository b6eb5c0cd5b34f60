"""Checkpoints and the final model.

    OUTPUT_DIR/checkpoints/step_<N>/
        state/               model + optimizer through torch.distributed.checkpoint (DCP), under
                             the full model's parameter names: each rank writes what it owns, so
                             the same format serves replicated (DDP) and sharded strategies
        trainer_state.json   step, data position, global batch, model config, and the size and
                             sha256 of every other file of the checkpoint (written last)
        scheduler.pt         LR schedule
        rng/rank_<r>.pt      every rank's RNG (python, numpy, torch, cuda)
        extra_state.pt       a strategy's own state, if it has one (DiLoCo's outer optimizer)
    OUTPUT_DIR/model/        model.safetensors + config.json (+ data.json: which data it learned,
                             + task.json: where a Task of the user's own lives, for evaluate.py)

A save is written to `checkpoints/.tmp_step_<N>` and renamed once complete, so a kill at any moment
leaves the previous checkpoint (docs/fault-tolerance.md). A resume checks every file against
trainer_state.json first: a damaged one is one line. Save, load and export are collectives: every
rank calls them. Checkpoints and `model/` need a file system shared by all machines.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import random
import re
import shutil
import warnings
from contextlib import contextmanager
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
from .errors import NothingToDo, UsageError

STATE_FILE = "trainer_state.json"
EXTRA_STATE_FILE = "extra_state.pt"  # a strategy's own state (save_checkpoint(extra_state=...))
TASK_FILE = "task.json"  # in model/: where a Task of the user's own lives (evaluate.py rebuilds the model with it)
# Optimizer state keyed by parameter name ("optim.state.blocks.3.mlp.up_proj.weight.exp_avg"),
# not by position in a param group: pipeline stages hold different parameters in "the same"
# groups, and another layout must find each parameter's state by its name.
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


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


def read_checkpoint_state(path: Path) -> dict:
    """Read and check a checkpoint's small files before anything is built or written."""
    try:
        state = json.loads((path / STATE_FILE).read_text())
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
    return state


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
    earlier = [p for p in list_checkpoints(path.parent.parent) if int(p.name.split("_")[1]) < state["step"]]
    resume = f"resume from an earlier checkpoint (--resume_from_checkpoint {earlier[-1]}), or " if earlier else ""
    raise UsageError(
        f"--resume_from_checkpoint {path}: {name} {what}{more}: this checkpoint cannot be resumed; "
        f"{resume}start over (--overwrite_output_dir, or another --output_dir)"
    )


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


def check_resume_and_output(
    accelerator, args, model, task, global_batch_size: int, layout=None
) -> tuple[Path | None, dict]:
    """Before anything is written: find and check the checkpoint to resume, refuse to start a run on top
    of another, clear it on --overwrite_output_dir. Returns the checkpoint (or None) and the facts every
    checkpoint of this run records besides the tensors (what a resume must match)."""
    facts = {
        "global_batch_size": global_batch_size,
        "world_size": accelerator.num_processes,
        "seed": args.seed,
        "param_shapes": {name: list(p.shape) for name, p in model.named_parameters()},  # before any cut
        "model_config": task.config(),
        **({"layout": layout.describe()} if layout is not None else {}),
    }
    resume_path = resolve_checkpoint(args.resume_from_checkpoint, args.output_dir)
    if resume_path:
        state = read_checkpoint_state(resume_path)
        check_checkpoint_files(resume_path, state)
        check_compatible(state, resume_path, facts["param_shapes"], global_batch_size)
        if state["step"] >= args.max_steps:  # a finished run: change nothing
            raise NothingToDo(
                f"{resume_path} is already at --max_steps {args.max_steps}: nothing to do "
                "(raise --max_steps to train further)"
            )
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
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of an interrupted save
        (tmp / "rng").mkdir(parents=True)
    accelerator.wait_for_everyone()
    model_sd, optim_sd = get_state_dict(model, _unwrap_optimizer(optimizer), options=OPTIONS)
    state_dir = tmp / "state" / f"rank_{accelerator.process_index}" if per_rank_state else tmp / "state"
    with _each_rank_alone(per_rank_state):
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(state_dir), no_dist=per_rank_state)
    torch.save(_rng_state(), tmp / "rng" / f"rank_{accelerator.process_index}.pt")
    if accelerator.is_main_process:
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        if extra_state is not None:  # inside the checkpoint before it is published: whole or not at all
            torch.save(extra_state, tmp / EXTRA_STATE_FILE)
    accelerator.wait_for_everyone()  # every rank's files are written (DCP wrote its metadata last)
    files = record_checkpoint_files(tmp)  # what a resume checks first: every file, its size and digest
    if accelerator.is_main_process:
        state = {**trainer_state, "per_rank_state": per_rank_state, "files": files}
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        publish_checkpoint(tmp, final, output_dir, args.keep_last)
    accelerator.wait_for_everyone()
    return final


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


def load_checkpoint(accelerator, path: Path | None, model, optimizer, scheduler) -> dict:
    """Collective: restores model, optimizer, scheduler and RNG in place; returns where the run stands
    (no path: step 0)."""
    if path is None:
        return {"step": 0, "epoch": 0, "samples_in_epoch": 0}
    state = json.loads((path / STATE_FILE).read_text())
    model_sd, optim_sd = get_state_dict(model, _unwrap_optimizer(optimizer), options=OPTIONS)
    to_load = {"model": model_sd, "optim": optim_sd}
    per_rank = state.get("per_rank_state", False)
    saved_rank = accelerator.process_index % state.get("world_size", accelerator.num_processes)  # elastic: r mod N
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
    """Collective: write `model/` the task's way (Task.export), from the main process. Under pipeline
    parallelism one rank per stage sends its stage's tensors. BatchNorm's running statistics are averaged
    first: the export is the model the run evaluated."""
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
    if accelerator.is_main_process:
        task.export(full_sd, model_dir, data_source)
        record_task(task, model_dir)
    accelerator.wait_for_everyone()


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
