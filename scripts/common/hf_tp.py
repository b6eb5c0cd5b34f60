"""A 🤗 model's TP plan, read from its own config (config.base_model_tp_plan): transformers' style names as
torch's ParallelStyles, the block inputs, Megatron's replicated KV heads, and the refusals of what
train_tp.py cannot cut. Imported only when a 🤗 model runs under TP (train_tp.py's model_tp_plan).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from .errors import UsageError
from .hf import check_untied
from .tp_checks import key_matches

if TYPE_CHECKING:  # annotations only: the layout module is not needed to run this one
    from .layout import Layout


def hf_styles(between, local: bool) -> dict:
    """transformers' TP style names (the values of config.base_model_tp_plan) as torch's ParallelStyles.
    `between`: the residual stream's layout between blocks (Shard(1), the sequence, under --sequence_parallel;
    else Replicate()); `local`: whether a row-wise output leaves as a plain tensor (not under SP)."""
    reduced = {"output_layouts": between, "use_local_output": local}  # Megatron's g: all-reduce / reduce-scatter
    return {
        # weight rows (outputs) cut: each rank computes heads/tp heads, or MLP columns/tp; the output stays cut
        "colwise": ColwiseParallel(),
        # a fused projection (Phi-3's qkv_proj = q|k|v, gate_up_proj = gate|up): cut column-wise, its output then
        # all-gathered, so the model's split by position (q = out[..., :heads*head_dim]) takes the whole q|k|v,
        # as one process does (a plain column-wise cut would hand rank 0 all of q and rank 1 k and v)
        "colwise_gather_output": ColwiseParallel(output_layouts=Replicate()),
        "colwise_rep": ColwiseParallel(output_layouts=Replicate()),
        # weight columns (inputs) cut: the partial sums are added over the group
        "rowwise": RowwiseParallel(**reduced),
        # after a gathered column-wise layer the input is whole on every rank: each takes its slice of it first
        "rowwise_split_input": RowwiseParallel(input_layouts=Replicate(), **reduced),
        "rowwise_rep": RowwiseParallel(input_layouts=Replicate(), **reduced),
        # Qwen3's, Gemma 3's q_norm/k_norm: a norm over each head's head_dim, run on this rank's heads. As a module
        # sharded over the heads dimension of (batch, seq, heads, head_dim), its weight is a replicated DTensor
        # whose gradient is summed over the group (a plain weight would keep this rank's part of the gradient)
        "replicated_with_grad_allreduce": SequenceParallel(sequence_dim=2, use_local_output=True),
        # vocabulary-parallel embedding: vocab/tp rows per rank, the partial lookups summed
        "embedding_rowwise": RowwiseParallel(input_layouts=Replicate(), **reduced),
        "replicate": None,  # every rank keeps the whole parameter: nothing to do
    }


# 3-D expert weights (Mixtral, Qwen3-MoE, DeepSeek-V3): cut inside the experts' batched matmuls, which this
# script does not do; expert parallelism (train_ep.py) places whole experts instead
MOE_STYLES = ("packed_colwise", "packed_rowwise", "moe_tp_experts", "moe_identity_expert", "grouped_gemm")
KV_PROJECTIONS = ("k_proj", "v_proj")  # the projections of the key/value heads (fused ones: qkv_proj ...)


class BlockInput(ParallelStyle):
    """The residual stream into an attention or MLP block (its first argument, or hidden_states=), made one
    replicated DTensor (all-gathered from the sequence slices under SP): the block's projections share it,
    so backward reduces its gradient once. `replicated`: a block the plan does not cut (DeepSeek-V3's
    attention, gpt-oss's experts) runs whole on every rank on a plain tensor, and under SP its output is cut
    back to this rank's slice of the sequence. `kv_groups`: query heads per KV head on each rank, where KV
    heads are replicated (KVHeadsReplicated): the attention repeats its KV heads that many times."""

    def __init__(self, between, replicated: bool = False, kv_groups: int | None = None):
        super().__init__()
        self.between, self.replicated, self.kv_groups = between, replicated, kv_groups

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def whole(x):
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, [self.between], run_check=False)
            x = x.redistribute(device_mesh, [Replicate()])
            return x.to_local() if self.replicated else x

        def gather_input(_, args, kwargs):
            if args:
                return (whole(args[0]), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": whole(kwargs["hidden_states"])}

        def cut_output(_, args, kwargs, output):
            first = output[0] if isinstance(output, tuple) else output
            first = DTensor.from_local(first, device_mesh, [Replicate()], run_check=False)
            first = first.redistribute(device_mesh, [self.between])
            return (first, *output[1:]) if isinstance(output, tuple) else first

        module.register_forward_pre_hook(gather_input, with_kwargs=True)
        if self.replicated and self.between != Replicate():
            module.register_forward_hook(cut_output, with_kwargs=True)
        if self.kv_groups is not None:
            module.num_key_value_groups = self.kv_groups
        return module


class _SumOverCopies(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the ranks that hold the same KV head."""

    @staticmethod
    def forward(ctx, weight, group):
        ctx.group = group
        return weight

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class KVHeadsReplicated(ParallelStyle):
    """k_proj / v_proj when the model has fewer KV heads than --tp_size (Megatron's answer): the TP group is
    viewed as (KV heads) x (copies), and each rank keeps the rows of the one KV head its query heads use
    (rank r: KV head r // copies), a DTensor Shard(0) over the heads and Replicate() over the copies. Each copy
    computes with its query heads' part of the gradient: the copies' gradients are summed, so every copy of
    a head takes the same update and they stay equal; the input's gradient is partial, as column-wise."""

    def __init__(self, n_kv_heads: int):
        super().__init__()
        self.n_kv_heads, self.kv_mesh = n_kv_heads, None

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if self.kv_mesh is None:  # one (heads x copies) view of the group for every k_proj/v_proj
            copies = device_mesh.size() // self.n_kv_heads
            self.kv_mesh = device_mesh._unflatten(0, (self.n_kv_heads, copies), ("tp_kv_heads", "tp_kv_copies"))
        kv_mesh, copies_group = self.kv_mesh, self.kv_mesh.get_group("tp_kv_copies")
        for name, param in list(module.named_parameters(recurse=False)):
            shard = distribute_tensor(param.detach(), kv_mesh, [Shard(0), Replicate()])
            module.register_parameter(name, nn.Parameter(shard, requires_grad=param.requires_grad))

        def forward(x):
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
            x = x.to_local(grad_placements=[Partial()])  # this rank's heads give part of the input's gradient
            weight = _SumOverCopies.apply(module.weight.to_local(), copies_group)
            bias = None if module.bias is None else _SumOverCopies.apply(module.bias.to_local(), copies_group)
            return nn.functional.linear(x, weight, bias)

        module.forward = forward
        return module


def hf_tp_plan(model: nn.Module, units_path: str, layout: Layout, sequence_parallel: bool, loss_parallel: bool) -> dict:
    """The plan of a 🤗 model, keyed from the root (model.layers.3.self_attn.q_proj), for the parts this rank
    holds (a pipeline stage's dropped layers are nn.Identity, skipped): the family's own base_model_tp_plan
    through hf_styles, plus ours:
    - the input embedding vocabulary-parallel, the output layer column-wise (Shard(-1) kept: loss parallel);
    - each attention/MLP block (a decoder layer's child holding planned projections) takes its input as one
      replicated DTensor (BlockInput); a block the plan leaves whole runs replicated;
    - sequence parallel: the norms (children of the decoder layer and of the base model) on Shard(1), the
      residual stream a DTensor: 🤗 reads the sequence length off the embeddings for the positions, rotary
      cos/sin and the mask, and a DTensor reports the whole length;
    - KV heads fewer than tp: replicated over the ranks that share them (KVHeadsReplicated), where TP is the
      whole layout (train_tp.py; beside FSDP or PP in train_hybrid.py that view of the group is not built)."""
    c, family, tp = model.config, model.config.model_type, layout.tp
    check_untied(model, "tensor parallelism")
    family_plan = dict(getattr(c, "base_model_tp_plan", None) or {})
    if not family_plan:
        raise UsageError(
            f"--tp_size: {family} has no TP plan in transformers (config.base_model_tp_plan is empty), so nothing "
            "says how to cut its layers: train it with train_fsdp.py, or give its config a base_model_tp_plan"
        )
    prefix = f"{model.base_model_prefix}." if model.base_model_prefix else ""
    between, local = (Shard(1), False) if sequence_parallel else (Replicate(), True)
    styles = hf_styles(between, local)
    modules = dict(model.named_modules())
    emb, head = _name_of(model, model.get_input_embeddings()), _name_of(model, model.get_output_embeddings())
    params = [name for name, _ in model.named_parameters()]
    plan, style_of = {}, {}  # style_of: {module name: the family's style name}
    for key, style in family_plan.items():  # every check first, so that no rank builds anything it would refuse
        names = [n for n in modules if key_matches(prefix + key, n) and n not in (emb, head)]  # ours: below
        bare = not names and any(key_matches(prefix + key, n) for n in params)  # a parameter (attention sinks)
        if not names and not bare:  # a part this family's config does not build here (or the embeddings: ours)
            continue
        if style in MOE_STYLES or style.startswith("ep_"):
            raise UsageError(
                f"--tp_size: {family}'s TP plan cuts its experts' 3-D weights ({prefix}{key}: {style}), which "
                "train_tp.py does not split: train a mixture-of-experts model with train_ep.py (expert parallel) "
                "or train_fsdp.py"
            )
        if bare:
            raise UsageError(
                f"--tp_size: {family}'s TP plan cuts the parameter {prefix}{key} ({style}) inside the forward of "
                "the module that holds it, which train_tp.py does not do (it cuts modules): train it with "
                "train_fsdp.py"
            )
        if style not in styles:
            mapped = ", ".join(s for s in styles if s != "replicate")
            raise UsageError(
                f"--tp_size: {family}'s TP plan puts {prefix}{key} on style '{style}', which train_tp.py does not map "
                f"to a torch ParallelStyle (it maps {mapped}, replicate): train it with train_fsdp.py"
            )
        kind = nn.Linear if style.startswith(("colwise", "rowwise")) else None
        odd = [
            n for n in names if kind is not None and not isinstance(getattr(modules[n], "base_layer", modules[n]), kind)
        ]  # LoRA: its base
        if odd:
            raise UsageError(
                f"--tp_size: {family}'s TP plan puts {odd[0]} ({type(modules[odd[0]]).__name__}) on style "
                f"'{style}', which torch's ParallelStyles cut only in nn.Linear layers: train it with train_fsdp.py"
            )
        if styles[style] is not None:
            plan.update(dict.fromkeys(names, styles[style]))
            style_of.update(dict.fromkeys(names, style))
    heads, kv_heads = c.num_attention_heads, getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    kv_keys = [n for n, s in style_of.items() if s == "colwise" and n.rsplit(".", 1)[-1] in KV_PROJECTIONS]
    replicate_kv = kv_heads % tp != 0 and bool(kv_keys)
    check_hf_tp_divides(model, style_of, prefix, heads, kv_heads, tp)
    if replicate_kv and layout.world_size != tp:
        fits = [d for d in range(2, kv_heads + 1) if kv_heads % d == 0][:4]  # the degrees that cut them whole
        raise UsageError(
            f"--tp_size {tp}: the model's {kv_heads} key/value heads are fewer than the TP ranks, and their copies "
            "(Megatron's replication) are made by train_tp.py alone, not beside data or pipeline parallelism: use "
            + (f"--tp_size {' or '.join(map(str, fits))}" if fits else "no TP beside them (--tp_size 1)")
            + f", or train_tp.py --tp_size {tp} on {tp} processes"
        )
    if replicate_kv:
        kv_style = KVHeadsReplicated(kv_heads)
        plan.update({k: kv_style for k in kv_keys})
    if emb is not None:
        plan[emb] = styles["embedding_rowwise"]
    layers = model.get_submodule(units_path)
    if sequence_parallel:  # the base model's other parts with weights would meet the sequence slices whole
        base = model.base_model
        kept = {model.get_input_embeddings(), layers}
        other = [n for n, m in base.named_children() if m not in kept and not _is_norm(m) and any(m.parameters())]
        if other:
            raise UsageError(
                f"--sequence_parallel: {family}'s base model holds {', '.join(other)} beside its embedding, decoder "
                "layers and norms, which would meet the sequence slices whole: drop --sequence_parallel"
            )
    for i, layer in enumerate(layers):
        if isinstance(layer, nn.Identity):  # another pipeline stage's layer
            continue
        p = f"{units_path}.{i}"
        if sequence_parallel and any(True for _ in layer.parameters(recurse=False)):
            raise UsageError(
                f"--sequence_parallel: {family}'s decoder layer ({type(layer).__name__}) holds parameters of its own, "
                "outside its norms and blocks, which would meet the sequence slices whole: drop --sequence_parallel"
            )
        for child_name, child in layer.named_children():
            name = f"{p}.{child_name}"
            planned = [k for k in plan if k.startswith(name + ".")]
            if _is_norm(child):
                if sequence_parallel:
                    plan[name] = SequenceParallel()
            elif planned:
                if sequence_parallel and not any(isinstance(plan[k], RowwiseParallel) for k in planned):
                    raise UsageError(
                        f"--sequence_parallel: {name} has no row-wise projection to cut its output back to the "
                        f"sequence slices (its planned layers: {', '.join(k[len(name) + 1 :] for k in planned)}): "
                        "drop --sequence_parallel"
                    )
                kv_groups = heads // tp if replicate_kv and any(k in kv_keys for k in planned) else None
                plan[name] = BlockInput(between, kv_groups=kv_groups)
            elif sequence_parallel and any(True for _ in child.parameters()):
                plan[name] = BlockInput(between, replicated=True)
    if head is not None:
        if sequence_parallel:  # the base model's final norm(s)
            base = model.base_model
            for child_name, child in base.named_children():
                if _is_norm(child):
                    plan[f"{prefix}{child_name}"] = SequenceParallel()
        # loss parallel: logits stay sharded over the vocabulary; the loss is computed on the shards
        plan[head] = ColwiseParallel(
            input_layouts=between,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    return plan


def check_hf_tp_divides(model: nn.Module, style_of: dict, prefix: str, heads: int, kv_heads: int, tp: int) -> None:
    """Before anything is cut: --tp_size divides what the plan splits. Column-wise q/k/v give each rank heads/tp
    heads (🤗 attention reshapes with view(..., -1, head_dim), so it runs on whatever it holds), KV heads
    fewer than tp are replicated (a multiple of them, then); every column-wise layer's outputs, row-wise
    layer's inputs and the vocabulary split evenly (gloo gathers equal pieces only)."""
    sizes = {}  # {what: size}
    if any(s == "colwise" and ("attn" in n or "attention" in n) for n, s in style_of.items()):
        sizes["attention heads (num_attention_heads)"] = heads
    cuts_kv = False  # k_proj / v_proj column-wise: KV heads cut, or replicated where fewer than tp
    for name, style in style_of.items():
        key = ".".join("*" if part.isdigit() else part for part in name.removeprefix(prefix).split("."))
        module = model.get_submodule(name)
        if style == "colwise" and name.rsplit(".", 1)[-1] in KV_PROJECTIONS:
            cuts_kv = True
        elif style.startswith("colwise"):
            sizes[f"{key} outputs (out_features)"] = module.out_features
        elif style.startswith("rowwise"):
            sizes[f"{key} inputs (in_features)"] = module.in_features
    sizes["vocabulary rows (vocab_size)"] = model.config.vocab_size

    def fits(d: int) -> bool:
        kv_fits = not cuts_kv or kv_heads % d == 0 or d % kv_heads == 0
        return kv_fits and all(n % d == 0 for n in sizes.values())

    fix = [d for d in range(2, 65) if fits(d)]
    fix = (
        f"use --tp_size {' or '.join(map(str, fix[:4]))}" if fix else "train it with train_fsdp.py (no --tp_size fits)"
    )
    if cuts_kv and kv_heads % tp and tp % kv_heads:
        raise UsageError(
            f"--tp_size {tp} neither divides the model's {kv_heads} key/value heads (num_key_value_heads) nor is a "
            f"multiple of them, so they can be neither cut nor replicated whole over the ranks: {fix}"
        )
    for what, size in sizes.items():
        if size % tp:
            raise UsageError(f"--tp_size {tp} does not divide the model's {size} {what}: {fix}")


def _name_of(model: nn.Module, module: nn.Module | None) -> str | None:
    return next((n for n, m in model.named_modules() if m is module), None) if module is not None else None


def _is_norm(module: nn.Module) -> bool:
    """A LayerNorm / RMSNorm, by its class name: no submodules, 1-D weights only."""
    no_children = next(module.children(), None) is None
    return "norm" in type(module).__name__.lower() and no_children and all(p.dim() == 1 for p in module.parameters())
