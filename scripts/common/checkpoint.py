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
is one line. `model/` is written beside itself (OUTPUT_DIR/.export_model) and renamed once whole; a failed
export removes it and is one line. Save, load and export are collectives: every rank calls them.
Checkpoints and `model/` need a file system shared by all machines.

This module is what the run's steps do: where it starts (start_point), the load, the save, the export. What
the folder holds: common/checkpoint_format.py; the writing of a checkpoint: common/checkpoint_save.py, the
reading of one: common/checkpoint_resume.py, each imported only by a run that saves, or resumes. The guards
beside them (the lock on --output_dir, the checks of a resume, the trial checkpoint before step 1) are
common/output_checks.py's, each started by a line of the script.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
from pathlib import Path

import torch
from accelerate.utils import gather_object
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from .batchnorm import average_running_stats
from .checkpoint_format import checkpoints_dir, list_checkpoints
from .errors import UsageError

TASK_FILE = "task.json"  # in model/: where a Task of the user's own lives (evaluate.py rebuilds the model with it)
# The flags that shape what a step trains on (the batches' masks, BatchNorm's statistics): a resume with
# another value would go on silently as another run, so the checkpoint records them (check_same_data_flags).
DATA_FLAGS = ("document_mask", "sync_batchnorm")


def resolve_checkpoint(arg: str | None, output_dir) -> Path | None:
    if arg is None:
        return None
    found = list_checkpoints(output_dir) if arg in ("auto", "latest") else None
    if arg == "auto":  # restarts and requeued jobs: resume if there is a complete checkpoint, else start
        return found[-1] if found else None
    if arg == "latest":
        if not found:
            raise UsageError(
                f"--resume_from_checkpoint latest: no checkpoint in {checkpoints_dir(output_dir)}"
                " (run without it, or with --checkpoint_every N)"
            )
        return found[-1]
    path = Path(arg)
    if not path.is_dir():
        raise UsageError(f"--resume_from_checkpoint {arg}: no such checkpoint directory")
    return path


def data_flags_of(args, model) -> dict:
    """DATA_FLAGS' values, where the script has the flag (a copy for one's own model may drop them);
    --sync_batchnorm only where the model has BatchNorm (elsewhere it changes nothing)."""
    has_batchnorm = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    return {
        name: getattr(args, name)
        for name in DATA_FLAGS
        if getattr(args, name, None) is not None and (name != "sync_batchnorm" or has_batchnorm)
    }


def start_point(accelerator, args, model, task, global_batch_size: int, layout=None) -> tuple[Path | None, dict]:
    """Where the run starts: the checkpoint --resume_from_checkpoint names (None: step 0), and the facts every
    checkpoint of this run records besides the tensors, taken before any cut (what a resume must match)."""
    facts = {
        "global_batch_size": global_batch_size,
        "world_size": accelerator.num_processes,
        "seed": args.seed,
        "param_shapes": {name: list(p.shape) for name, p in model.named_parameters()},  # before any cut
        "model_config": task.config(),
        "data_flags": data_flags_of(args, model),  # what shapes the batches and the normalisation
        **({"layout": layout.describe()} if layout is not None else {}),
    }
    return resolve_checkpoint(args.resume_from_checkpoint, args.output_dir), facts


def load_checkpoint(accelerator, path: Path | None, model, optimizer, scheduler, replicas: bool = False) -> dict:
    """Collective: restores model, optimizer, scheduler and RNG in place; returns where the run stands
    (no path: step 0). A checkpoint of replicas saved between fusions (Local SGD) gives each rank its own
    (`replicas`: the caller keeps them apart), or, to any other strategy, rank 0's on every rank: one model."""
    if path is None:
        return {"step": 0, "epoch": 0, "samples_in_epoch": 0}
    from .checkpoint_resume import restore  # only a resumed run reads a checkpoint

    return restore(accelerator, path, model, optimizer, scheduler, replicas)


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
