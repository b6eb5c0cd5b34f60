"""train_tp.py's refusals, one line each, before anything is cut: a plan that does not fit the model or
leaves a flag nothing to act on (check_tp_plan), a layout that is not TP only (check_tp_layout), flags
the layout or the data cannot serve (check_tp_flags). And the help of train_tp.py's flags (HELP).
"""

from __future__ import annotations

from fnmatch import fnmatch
from typing import TYPE_CHECKING

import torch.nn as nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel

from .errors import UsageError

if TYPE_CHECKING:  # annotations only: the layout module is not needed to run this one
    from .layout import Layout

WHERE = "in the MODEL section of train_tp.py (docs/your-model.md)"
HELP = {  # the help of train_tp.py's flags, beside the checks that hold them to it
    "tp_size": "ranks per TP group: all processes (-1, or their number); data parallel beside TP is train_hybrid.py's",
    "sequence_parallel": (
        "shard LayerNorm/dropout activations along the sequence (all-gather + reduce-scatter instead of all-reduce)"
    ),
    "loss_parallel": "compute the cross-entropy on vocabulary-sharded logits, never gathering them",
}


def check_tp_plan(model: nn.Module, plan: dict, sequence_parallel: bool, loss_parallel: bool) -> None:
    """Before parallelize_module, which only warns about a key that matches no module (and leaves that
    part whole), and would apply a plan that has no place for a flag (the flag then changes nothing):
    every key names a module of the model; --sequence_parallel has a SequenceParallel style to act on;
    --loss_parallel has an output layer that keeps its logits sharded over the vocabulary. One line each."""
    if not plan:  # one rank per TP group: nothing is cut, and check_tp_flags says what the flags need
        return
    names = [name for name, _ in model.named_modules() if name]
    unmatched = [key for key in plan if key and not any(key_matches(key, name) for name in names)]
    if unmatched:
        more = f" (and {len(unmatched) - 1} more key{'s' if len(unmatched) > 2 else ''})" if len(unmatched) > 1 else ""
        raise UsageError(
            f"the TP plan names '{unmatched[0]}'{more}, but the model ({type(model).__name__}) has no module by "
            f"that name; {_what_the_model_has(model, unmatched[0])}: name the model's modules in its TP plan, {WHERE}"
        )
    kinds = sorted({type(style).__name__ for style in plan.values()})
    if sequence_parallel and not any(isinstance(style, SequenceParallel) for style in plan.values()):
        raise UsageError(
            "--sequence_parallel: the TP plan has no SequenceParallel style (for the norms, which then work on a "
            f"slice of the sequence), only {', '.join(kinds)}: the plan ignores the flag; place SequenceParallel() "
            f"on the norms when sequence_parallel is set, {WHERE}, or drop --sequence_parallel"
        )
    if loss_parallel and not any(_shards_vocabulary(style) for style in plan.values()):
        columns = [(key, style) for key, style in plan.items() if isinstance(style, ColwiseParallel)]
        last = f"its last column-wise layer, {_output_of(*columns[-1])}" if columns else "it has no column-wise layer"
        raise UsageError(
            "--loss_parallel: the TP plan has no output layer that keeps its logits sharded over the vocabulary "
            f"(ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)); {last}: the plan ignores the "
            f"flag; shard the output layer that way when loss_parallel is set, {WHERE}, or drop --loss_parallel"
        )


def key_matches(key: str, name: str) -> bool:
    """parallelize_module's matching: one fnmatch pattern per dotted part."""
    parts, pattern = name.split("."), key.split(".")
    return len(parts) == len(pattern) and all(fnmatch(p, q) for p, q in zip(parts, pattern, strict=True))


def _what_the_model_has(model: nn.Module, key: str) -> str:
    """The model's top-level modules, and those under the deepest part of `key` it has (else its first unit)."""

    def children(module: nn.Module) -> str:
        names = [name for name, _ in module.named_children()]
        return ", ".join(names[:8]) + (", ..." if len(names) > 8 else "") or "none"

    parts = key.split(".")
    found = ""
    for i in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:i])
        try:
            found = f"{prefix} holds {children(model.get_submodule(prefix))}"
            break
        except AttributeError:
            continue
    if not found:
        units = next(
            ((n, m) for n, m in model.named_modules() if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and len(m)), None
        )
        if units:
            first = next(iter(units[1].named_children()))
            found = f"its first unit, {units[0]}.{first[0]}, holds {children(first[1])}"
    return f"its top-level modules are {children(model)}" + (f"; {found}" if found else "")


def _shards_vocabulary(style) -> bool:
    return isinstance(style, ColwiseParallel) and not style.use_local_output and Shard(-1) in style.output_layouts


def _output_of(key: str, style) -> str:
    layouts = ", ".join(repr(layout) for layout in style.output_layouts)
    return f"'{key}', outputs {layouts} as a {'local tensor' if style.use_local_output else 'DTensor'}"


def check_tp_layout(layout: Layout) -> None:
    """train_tp.py is TP only: a --tp_size that leaves data-parallel groups beside TP is train_hybrid.py's."""
    if layout.dp > 1:
        n = layout.world_size
        raise UsageError(
            f"--tp_size {layout.tp} on {n} processes leaves {layout.dp} data-parallel groups, but train_tp.py is "
            f"tensor parallel only: drop --tp_size (TP over all {n} processes), or train data parallel beside TP "
            f"with train_hybrid.py --dp_shard {layout.dp} --tp_size {layout.tp}"
            + (" (no TP split at all: train_fsdp.py)" if layout.tp == 1 else "")
        )


def check_tp_flags(layout: Layout, task, sequence_parallel: bool, loss_parallel: bool) -> None:
    """--sequence_parallel / --loss_parallel need a TP group; sequence parallel also needs samples that
    are sequences (Task.tokens_per_sample), and every rank an equal slice of them (docs/troubleshooting.md,
    "Sequence parallel needs a divisible sequence length")."""
    if layout.tp == 1 and (sequence_parallel or loss_parallel):
        flag = "sequence_parallel" if sequence_parallel else "loss_parallel"
        raise UsageError(
            f"--{flag} shards over the TP group, but --tp_size is 1: use --tp_size 2 or more, or drop --{flag}"
        )
    seq_len = task.tokens_per_sample
    if sequence_parallel and not seq_len:
        raise UsageError(
            "--sequence_parallel splits each sample's sequence over the TP ranks, but this task's samples are not "
            "sequences (Task.tokens_per_sample is None): drop --sequence_parallel"
        )
    if sequence_parallel and seq_len % layout.tp:
        hint = {
            "addition": "choose --addition_digits d with 3d+4 divisible by it (d = 4 gives 16 tokens)",
            "text": "use a --block_size divisible by it",
        }.get(getattr(task, "data_task", None), "use samples whose length it divides")
        raise UsageError(
            f"--sequence_parallel splits the {seq_len}-token sequence over --tp_size {layout.tp} ranks, "
            f"which does not divide it: {hint}"
        )
