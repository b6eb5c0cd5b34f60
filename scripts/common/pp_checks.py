"""The pipeline's refusals, one line each, before step 1: a --pp_size that is not every process
(check_pp_size); the pipeline flags against the layout and the model (check_pipeline_layout); stages
that, chained, do not compute the whole 🤗 model (check_stages_compute); a rank that keeps parameters
its stages do not train (check_stage_parameters).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from .errors import UsageError
from .pipeline import MULTI_STAGE_SCHEDULES

if TYPE_CHECKING:
    from .layout import Layout


def check_pp_size(pp_size: int, world: int) -> None:
    """One strategy per file: every process is one pipeline rank; dp x pp is train_hybrid.py's."""
    if pp_size not in (-1, world):
        raise UsageError(
            f"--pp_size {pp_size} on {world} processes: train_pp.py is pure pipeline parallel, "
            "every process one pipeline rank (drop --pp_size); pipelines trained data parallel "
            f"(dp x pp) are train_hybrid.py's: --pp_size N --dp_shard M, N x M = {world}"
        )


def check_pipeline_layout(layout: Layout, n_units: int, args, units_name: str = "repeated units") -> None:
    """The pipeline flags against the layout (pipeline ranks) and the model (its `n_units` repeated
    units, `units_name` saying what they are): every stage gets a unit, the batch splits into the
    micro-batches, the schedule has enough micro-batches in flight."""
    n_stages = layout.pp * args.stages_per_rank
    if n_stages > n_units:
        raise UsageError(
            f"--pp_size {layout.pp} x --stages_per_rank {args.stages_per_rank} = {n_stages} stages, but the model "
            f"has {n_units} units ({units_name}): every stage needs at least one; use fewer stages or a model with "
            "more units"
        )
    if args.batch_size % args.n_microbatches:
        raise UsageError(
            f"--batch_size {args.batch_size} cannot be split into --n_microbatches {args.n_microbatches} equal "
            "micro-batches: use a batch size divisible by it"
        )
    if args.gradient_accumulation_steps != 1:
        raise UsageError(
            "--gradient_accumulation_steps: the pipeline already accumulates over its micro-batches; raise "
            "--batch_size and --n_microbatches instead (and keep accumulation 1)"
        )
    if args.split_points is not None:
        points = args.split_points
        if len(points) != n_stages - 1 or points != sorted(set(points)) or points[0] <= 0 or points[-1] >= n_units:
            raise UsageError(
                f"--split_points {','.join(map(str, points))}: {n_stages} stages need {n_stages - 1} increasing "
                f"unit indices between 1 and {n_units - 1}"
            )
    if layout.pp > 1 and args.schedule != "gpipe" and args.n_microbatches < layout.pp:
        raise UsageError(
            f"--n_microbatches {args.n_microbatches} is fewer than the {layout.pp} pipeline ranks: --schedule "
            f"{args.schedule} needs at least one micro-batch per rank in flight (raise --n_microbatches, or use gpipe)"
        )
    if args.schedule in MULTI_STAGE_SCHEDULES and args.n_microbatches % layout.pp:
        raise UsageError(
            f"--n_microbatches {args.n_microbatches}: --schedule {args.schedule} needs a multiple of the "
            f"{layout.pp} pipeline ranks"
        )


def check_stages_compute(model: nn.Module, ranges: list[range], stage_modules, n_tokens: int = 64) -> None:
    """Before any part is dropped: the stages chained give the whole model's logits, on a few tokens
    (eval mode, no gradients, the global RNG untouched). Proof, for any 🤗 family, that its forward
    does nothing to the hidden states between the parts of its pipeline plan that a stage would miss
    or repeat (a family that does is refused, one line). Other models are not checked here: the
    built-in GPT's stages are its own embed/head code, a model of one's own has the cut check.
    `stage_modules`: train_pp.py's MODEL section's builder, given every stage."""
    transformers = sys.modules.get("transformers")  # not imported: no 🤗 model runs
    c = getattr(model, "config", None)
    is_hf = transformers is not None and isinstance(model, transformers.PreTrainedModel)
    if not is_hf or not hasattr(c, "vocab_size"):
        return
    stages = stage_modules(model, [(r, s == 0, s == len(ranges) - 1) for s, r in enumerate(ranges)])
    device = next(model.parameters()).device
    n_tokens = min(n_tokens, getattr(c, "max_position_embeddings", None) or n_tokens)
    ids = torch.randint(c.vocab_size, (2, n_tokens), generator=torch.Generator().manual_seed(0)).to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            whole, x = model(input_ids=ids).logits, ids
            for stage in stages:
                x = stage(x)
    finally:
        model.train(was_training)
    diff = (whole - x).abs().max().item() if x.shape == whole.shape else float("inf")
    if not diff <= 1e-5:
        raise UsageError(
            f"--pp_size: {c.model_type}'s {len(ranges)} pipeline stages, chained, do not give the "
            f"whole model's logits (max |diff| {diff:.2g} on {n_tokens} tokens): its forward does "
            "more to the hidden states than the parts of its pipeline plan "
            "(config.base_model_pp_plan) hold; train it with train_fsdp.py"
        )


def check_stage_parameters(model: nn.Module, stages: list[nn.Module], other_units: dict[int, nn.Module]) -> None:
    """After the split (with or without the cut check): the rank holds what its stages train and nothing
    of another stage's. `other_units`: {index: unit} of the units the other ranks' stages hold. Refused
    in one line naming the first parameter that is one of theirs, still in the model or in this rank's
    stages (a stage builder that takes blocks one by one, with Task.units_path a list of names, leaves
    the model's own blocks in place), or that the model holds and no stage of this rank runs (the first
    or last stage's parts where the rank holds no such stage): the rank would keep an untrained copy,
    and the export would write it over the trained one."""
    script = Path(sys.argv[0]).name
    theirs = {id(p): i for i, unit in other_units.items() for p in unit.parameters()}
    in_stages = {id(p) for stage in stages for p in stage.parameters()}
    held = [("model", n, p) for n, p in model.named_parameters()]
    held += [(f"stage module {k}", n, p) for k, stage in enumerate(stages) for n, p in stage.named_parameters()]
    for where, name, p in held:
        if id(p) in theirs:
            raise UsageError(
                f"{script}: {name}, a parameter of unit {theirs[id(p)]} (another rank's pipeline stage), is still "
                f"in this rank's {where}: name the units' container in Task.units_path (\"blocks\", not a list of "
                "its blocks), so that the split drops the other ranks' units, or drop them in the MODEL section's "
                'stage_modules (model.blocks[i] = nn.Identity()); docs/pp.md, "A model of your own"'
            )
        if id(p) not in in_stages:
            raise UsageError(
                f"{script}: {name} is in this rank's model but in none of its pipeline stages: the MODEL section's "
                "stage_modules must drop what this rank does not run (the first stage's parts where it holds no "
                "first stage, the last stage's where it holds no last: e.g. model.head = None), else it keeps an "
                'untrained copy that the export writes; docs/pp.md, "A model of your own"'
            )
