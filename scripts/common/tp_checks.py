"""train_tp.py's refusals, one line each, before anything is cut: a plan that does not fit the model or
leaves a flag nothing to act on (check_tp_plan), a layout that is not TP only (check_tp_layout), flags
the layout or the data cannot serve (check_tp_flags).
"""

from __future__ import annotations

from contextlib import nullcontext
from fnmatch import fnmatch
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from accelerate.utils import send_to_device
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel
from torch.utils.data import default_collate

from .errors import UsageError

if TYPE_CHECKING:  # annotations only: the layout module is not needed to run this one
    from .layout import Layout

WHERE = "in the MODEL section of train_tp.py (docs/your-model.md)"


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


def check_gpt_plan(model: nn.Module, task, tp: int) -> None:
    """The built-in GPT's plan (train_tp.py's tensor_parallel_plan) names the GPT's modules: a model of
    one's own whose plan is not written yet (model_tp_plan still ends in the GPT's) is refused in one
    line; the GPT's: TP divides its heads, MLP width and vocabulary (check_gpt_split)."""
    from .presets import GPTConfig, check_gpt_split  # the GPT's own run has them imported already

    gpt_parts = all(hasattr(model, part) for part in ("tok_emb", "blocks", "lm_head"))  # what its plan names
    if not gpt_parts or not isinstance(getattr(task, "cfg", None), GPTConfig):
        raise UsageError(
            f"train_tp.py cuts the model by its TP plan, and {type(model).__name__} has none yet: model_tp_plan "
            "still returns the built-in GPT's (tensor_parallel_plan); write your model's plan there, {module name: "
            "ColwiseParallel() or RowwiseParallel()}, in place of its last two lines, in the MODEL section at the "
            f'top of train_tp.py (docs/tp.md, "A plan not written yet"; {_what_the_model_has(model, "")}), '
            "or train it with train_fsdp.py"
        )
    check_gpt_split(task.cfg, tp)


@torch.no_grad()
def check_plan_forward(model: nn.Module, plan: dict, task, validation, device, context=None) -> None:
    """After the cut, before the contract check: one forward of 2 validation samples (eval mode, no gradients).
    An error raised after a column-wise entry's layer returned, before the next layer the plan names began,
    comes from the code that reads that layer's outputs: it expected them whole, and each rank holds 1/tp of
    them. The typical case is a fused projection (timm's qkv: q, k and v in one weight) cut column-wise, whose
    first 1/tp columns are not heads but q and part of k. One line naming the entry; an error anywhere else
    is check_task_contract's to say. `context`: what the forward runs in (train_hybrid.py's CP: whole sequences)."""
    local = {key for key, style in plan.items() if _cuts_outputs(style)}
    named = {name: m for name, m in model.named_modules() if name and any(key_matches(k, name) for k in plan)}
    if not local or len(validation) < 2:
        return
    after = [None]  # the column-wise layer whose outputs the code now running reads

    def began(*_):
        after[0] = None

    hooks = [m.register_forward_pre_hook(began) for m in named.values()]
    for name, m in named.items():
        if any(key_matches(k, name) for k in local):
            hooks.append(m.register_forward_hook(lambda *_, name=name: after.__setitem__(0, name)))
    batch = send_to_device(default_collate([validation[i] for i in range(2)]), device)
    was_training = model.training
    model.eval()
    try:
        with context or nullcontext():
            model(*task.inputs(batch))
    except Exception as e:
        if after[0] is None or isinstance(e, (UsageError, torch.distributed.DistBackendError)):
            return  # not the plan's: check_task_contract says it
        raise UsageError(_cut_outputs_line(after[0], named[after[0]], plan, e)) from None
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
        for module in model.modules():  # FSDP (train_hybrid.py) keeps a root gathered after forward
            if hasattr(module, "reshard") and hasattr(module, "set_requires_gradient_sync"):
                module.reshard()


def _cuts_outputs(style) -> bool:
    """A column-wise style whose layer hands the code after it a local shard of its outputs."""
    return (
        isinstance(style, ColwiseParallel)
        and style.use_local_output
        and any(isinstance(layout, Shard) for layout in style.output_layouts)
    )


def _cut_outputs_line(name: str, module: nn.Module, plan: dict, error: Exception) -> str:
    key = next(k for k in plan if key_matches(k, name) and _cuts_outputs(plan[k]))
    layer = f"its {type(module).__name__}" if key == name else f"the {type(module).__name__} {name}"
    weight = getattr(module, "weight", None)
    n_out, n_in = (weight.shape[0], weight.shape[1]) if weight is not None and weight.dim() == 2 else (0, 0)
    tp = weight.device_mesh.size() if isinstance(weight, DTensor) else 0
    holds = f" (each of the {tp} ranks holds {n_out // tp} of its {n_out} outputs)" if tp and n_out else ""
    raised = f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
    whole = f"leave {name} whole (no entry for it, nor a row-wise one for the layer after it)"
    if n_in and n_out % n_in == 0 and n_out // n_in > 1:  # q, k and v (or gate and up) in one weight
        why = (
            f"its {n_out} outputs are {n_out // n_in} x its {n_in} inputs, a fused projection (q, k and v in one "
            f"weight?), and a rank's {n_out // max(tp, 1)} columns are not its share of each one's heads. Cut q, k "
            f"and v into 3 layers, each ColwiseParallel, or {whole}"
        )
    else:
        why = f"the code after it reads its outputs whole, not a slice of them. Cut another layer, or {whole}"
    return (
        f"the TP plan entry '{key}' cuts {layer} column-wise{holds}, and the forward then raised {raised}: {why}, "
        'in model_tp_plan, the MODEL section of train_tp.py (docs/tp.md, "A fused projection")'
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
    if not found:  # the first container of units that hold modules of their own (timm's blocks: a Sequential)
        containers = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
        units = next(
            (
                (n, m)
                for n, m in model.named_modules()
                if isinstance(m, containers) and len(m) and any(True for _ in next(iter(m.children())).children())
            ),
            None,
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
