#!/usr/bin/env python
"""Tensor parallelism (Megatron-style) with PyTorch DTensor, under 🤗 Accelerate.

Every weight matrix of a block is cut across the ranks of a TP group; all of them see the same
batch and together compute one layer. Column-parallel layers split their outputs (attention
heads, MLP columns), row-parallel ones their inputs, so each pair needs one all-reduce:

    one block, tp = 2 (x: activations, replicated on both ranks)
                   rank 0                            rank 1
    f ->  q,k,v[:, heads 0..h/2)   attention    q,k,v[:, heads h/2..h)   attention     column-wise
          o_proj[heads 0..h/2 , :]  -> partial  o_proj[heads h/2..h, :]  -> partial    row-wise
    g ->                 all-reduce(partial + partial) = attention output
    f ->  up_proj[:, cols 0..2d)       GELU     up_proj[:, cols 2d..4d)      GELU      column-wise
          down_proj[cols 0..2d, :] -> partial   down_proj[cols 2d..4d, :] -> partial   row-wise
    g ->                 all-reduce = MLP output

    f: identity forward, all-reduce of the input gradient backward;  g: all-reduce forward, identity backward.
    Embedding: vocab rows split (each rank looks up the tokens it holds, partial sums all-reduced).
    LM head: vocab columns split; --loss_parallel computes the cross-entropy on the shards.
    --sequence_parallel: LayerNorms and dropout work on a slice of the sequence; each all-reduce
    becomes an all-gather (before attention/MLP) plus a reduce-scatter (after them).

Run it:
    accelerate launch --config_file accelerate_configs/cpu_multi.yaml scripts/train_tp.py
    accelerate launch --config_file accelerate_configs/gpu_multi.yaml scripts/train_tp.py \\
        --sequence_parallel --loss_parallel
    python scripts/train_tp.py                     # one process: nothing to split, the plan is not applied
TP only: the TP group is every process. Data parallel beside TP (dp x tp) is train_hybrid.py's.
The MODEL section holds the plan, {module name: how to split it}: the built-in GPT's, written by hand;
a 🤗 model's is read from its own config (config.base_model_tp_plan, through the style table of the
`# TP:` section; KV heads fewer than the ranks replicated, as Megatron does). Lines marked `# TP:` are
the strategy; `# Accelerate:` the library's part.
"""

import sys
from contextlib import nullcontext
from fnmatch import fnmatch
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts run as files: copy common/ beside this file

import torch
import torch.nn as nn
from accelerate.utils import set_seed
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from common.checkpoint import check_resume_and_output, export_model, load_checkpoint, save_checkpoint
from common.cli import batch_of_step, build_parser, check_core_args, data_source
from common.costs import count_parameters
from common.cut_check import check_cut, uncut_copy
from common.errors import UsageError
from common.evaluation import evaluate
from common.launch import make_accelerator, run_main
from common.layout import Layout
from common.loader import make_train_loader
from common.metrics import RunMonitor
from common.sharded import clip_grad_norm_, shard_loader
from common.sharded_costs import sharded_start_line, sharded_summary
from common.task import check_task_contract
from common.tied import check_tp_keeps_ties
from common.training import StepFeed, compile_units, make_optimizer, make_scheduler


# ======================================== MODEL: the TP plan, {module name: style} (docs/your-model.md)
def tensor_parallel_plan(model: nn.Module, sequence_parallel: bool, loss_parallel: bool) -> dict:
    """Megatron's split of the built-in GPT, as a parallelize_module plan (only for the parts this rank holds).

    Per block: q/k/v column-wise (each rank computes n_head/tp heads), o_proj row-wise;
    up_proj column-wise, down_proj row-wise. One all-reduce after o_proj and one after
    down_proj in forward (Megatron's g), one each at the block's inputs in backward (f).
    With sequence parallel the norms work on a slice of the sequence, and each all-reduce
    becomes an all-gather before attention/MLP plus a reduce-scatter after them."""
    seq = Shard(1)  # the sequence dimension of (batch, seq, hidden)
    between_blocks = seq if sequence_parallel else Replicate()
    plan = {}
    if model.tok_emb is not None:  # vocab-parallel: each rank holds vocab/tp rows; partial sums are reduced
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between_blocks)
        if sequence_parallel:  # positions of this rank's sequence slice, to add to its token slice
            plan["pos_emb"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=seq)
    for name in model.blocks:
        b = f"blocks.{name}"
        plan.update(
            {
                f"{b}.attn.q_proj": ColwiseParallel(),
                f"{b}.attn.k_proj": ColwiseParallel(),
                f"{b}.attn.v_proj": ColwiseParallel(),
                f"{b}.attn.o_proj": RowwiseParallel(output_layouts=between_blocks),
                f"{b}.mlp.up_proj": ColwiseParallel(),
                f"{b}.mlp.down_proj": RowwiseParallel(output_layouts=between_blocks),
                # attention and MLP take their input as one replicated DTensor (all-gathered from the sequence
                # slices under SP): q, k and v share it, so backward reduces its gradient once, not 3 times
                f"{b}.attn": PrepareModuleInput(input_layouts=(between_blocks,), desired_input_layouts=(Replicate(),)),
                f"{b}.mlp": PrepareModuleInput(input_layouts=(between_blocks,), desired_input_layouts=(Replicate(),)),
            }
        )
        if sequence_parallel:
            plan.update({f"{b}.ln_1": SequenceParallel(), f"{b}.ln_2": SequenceParallel()})
    if model.lm_head is not None:
        if sequence_parallel:
            plan["ln_f"] = SequenceParallel()
        # loss parallel: keep the logits sharded over the vocabulary; the loss is computed on the shards
        plan["lm_head"] = ColwiseParallel(
            input_layouts=between_blocks,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    return plan


def model_tp_plan(model: nn.Module, task, layout: Layout, sequence_parallel: bool, loss_parallel: bool) -> dict:
    """This model's plan, after checking that the TP degree divides what the plan splits (heads, MLP
    width, vocabulary): a 🤗 model's, from its own config (hf_tp_plan, below), else the built-in GPT's
    (above). A model of your own: return its plan here (docs/your-model.md)."""
    if getattr(task, "hf_config", None) is not None:  # a 🤗 transformers model (HFCausalLMTask)
        return hf_tp_plan(model, task.units_path, layout, sequence_parallel, loss_parallel)
    from common.model import check_gpt_split

    check_gpt_split(task.cfg, layout.tp)  # the GPTConfig: TP divides heads, MLP width (4 x n_embd), vocabulary
    return tensor_parallel_plan(model, sequence_parallel, loss_parallel)


# ---------------------------------------- TP: a 🤗 model's plan, read from its own config (docs/tp.md)
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
    from common.hf import check_untied  # only a 🤗 model comes here: the GPT's copy never loads the 🤗 code

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
        names = [n for n in modules if _key_matches(prefix + key, n) and n not in (emb, head)]  # ours: below
        bare = not names and any(_key_matches(prefix + key, n) for n in params)  # a parameter (attention sinks)
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
        odd = [n for n in names if kind is not None and not isinstance(modules[n], kind)]
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


# ======================================== TP: the strategy
WHERE = "in the MODEL section of train_tp.py (docs/your-model.md)"


def check_tp_plan(model: nn.Module, plan: dict, sequence_parallel: bool, loss_parallel: bool) -> None:
    """Before parallelize_module, which only warns about a key that matches no module (and leaves that
    part whole), and would apply a plan that has no place for a flag (the flag then changes nothing):
    every key names a module of the model; --sequence_parallel has a SequenceParallel style to act on;
    --loss_parallel has an output layer that keeps its logits sharded over the vocabulary. One line each."""
    names = [name for name, _ in model.named_modules() if name]
    unmatched = [key for key in plan if key and not any(_key_matches(key, name) for name in names)]
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


def _key_matches(key: str, name: str) -> bool:
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


def apply_tensor_parallel(model: nn.Module, tp_mesh, plan: dict) -> None:
    """parallelize_module swaps each weight the plan names for a DTensor shard over `tp_mesh` (a 1-D mesh)
    and adds the f/g collectives as hooks. `plan`: {module name: style}, the MODEL section's (model_tp_plan),
    checked with check_tp_plan first."""
    check_tp_keeps_ties(model, plan)  # a tied weight the plan cuts would train untied: one line instead
    parallelize_module(model, tp_mesh, plan)


def tp_forward_backward(
    accelerator,
    model,
    task,
    micro_batches: list,
    n_global_targets: torch.Tensor,
    use_loss_parallel: bool,
    dp_size: int = 1,
    counts_loss: bool = True,
    unsharded_accumulation: bool = False,
) -> torch.Tensor:
    """Forward and backward of this rank's micro-batches (the whole TP group runs the same ones);
    returns their loss sum where `counts_loss` (the ranks of a TP group hold the same sum: one per group
    counts it, layout.holds_loss), else zero. Normalised by the global batch's target count, times
    `dp_size` where a data-parallel part (FSDP, train_hybrid.py) averages gradients over dp ranks.
    `unsharded_accumulation` (FSDP beside TP): hold the whole gradients through the micro-batches and
    reduce-scatter once, at the last; else (the default) FSDP reduce-scatters after each micro-batch."""
    step_loss_sum = torch.zeros((), device=accelerator.device)
    for i, mb in enumerate(micro_batches):
        if unsharded_accumulation and isinstance(model, FSDPModule):  # one reduce-scatter, at the last
            model.set_requires_gradient_sync(i == len(micro_batches) - 1)
        with (
            accelerator.autocast(),
            loss_parallel() if use_loss_parallel else nullcontext(),
        ):  # TP: loss on vocab shards
            loss_sum, _ = task.loss_of(model, mb)
            accelerator.backward(loss_sum * dp_size / n_global_targets)  # Accelerate: backward
        step_loss_sum += loss_sum.detach().full_tensor() if isinstance(loss_sum, DTensor) else loss_sum.detach()
    return step_loss_sum if counts_loss else torch.zeros_like(step_loss_sum)


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


def tp_start_lines(model: nn.Module, plan: dict, layout: Layout, args, seq_len: int) -> tuple[list[str], dict]:
    """What the plan splits, and Megatron's count of the step's all-reduces (2 per row-wise Linear: g in
    forward, f in backward, each of b*s*d activations in fp32), for the start lines and the summary."""
    if layout.tp == 1:
        return ["tensor parallel: 1 rank per group: nothing to split, so the TP plan is not applied"], {}
    rowwise = [key for key, style in plan.items() if isinstance(style, RowwiseParallel)]
    row = [
        m
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and any(_key_matches(k, name) for k in rowwise)
    ]
    n_col = sum(isinstance(s, (ColwiseParallel, KVHeadsReplicated)) for s in plan.values())
    n_row = sum(isinstance(s, RowwiseParallel) for s in plan.values())
    width = max((m.out_features for m in row), default=0)
    mib = 4 * args.batch_size * seq_len * width / 2**20  # one all-reduce of b*s*d, fp32
    on_off = {True: "on", False: "off"}
    lines = [
        f"tensor parallel: {layout.tp} ranks per group; the plan splits {n_col} layers column-wise (outputs: heads, "
        f"MLP columns, vocabulary) and {n_row} row-wise (inputs), 1/{layout.tp} of each per rank; sequence parallel "
        f"{on_off[args.sequence_parallel]}, loss parallel {on_off[args.loss_parallel]}",
        f"Megatron's count per step: 2 all-reduces per row-wise layer of b*s*d = {mib:.3f} MiB "
        f"({2 * len(row)} for {len(row)} row-wise Linear layers); measured below",
    ]
    figures = {
        "megatron_allreduce_mib_each": round(mib, 4),
        "megatron_allreduces_per_step": 2 * len(row) * args.gradient_accumulation_steps,
    }
    kv = [(name, s) for name, s in plan.items() if isinstance(s, KVHeadsReplicated)]
    if kv:  # Megatron's copies of the KV heads: what each rank holds beyond an even 1/tp of those weights
        extra = round(
            sum(
                (p.to_local().numel() - p.numel() / layout.tp) * p.element_size()
                for name, _ in kv
                for p in model.get_submodule(name).parameters()
            )
        )
        states = 4 if args.optimizer == "adamw" else 2  # the weight, its gradient (and AdamW's two moments)
        n_kv = kv[0][1].n_kv_heads
        lines.append(
            f"KV heads: {n_kv} for {layout.tp} ranks, so each is replicated on {layout.tp // n_kv} ranks (Megatron): "
            f"every rank keeps the one its query heads use, in {len(kv)} k/v projections, {extra:,} bytes of weights "
            f"per rank over an even 1/{layout.tp} split of them ({states * extra:,} with their gradients and "
            f"{args.optimizer} state); the copies' gradients are summed"
        )
        figures["kv_copies_extra_weight_bytes_per_rank"] = extra
    return lines, figures


def main():
    # ---------------------------------------- flags
    parser = build_parser(__doc__)
    from common.builtin_flags import add_builtin_flags  # the built-in data sets' and models' flags

    add_builtin_flags(parser)  # data and a model of your own: drop these two lines
    g = parser.add_argument_group("tensor parallel")
    g.add_argument(
        "--tp_size",
        type=int,
        default=-1,
        help="ranks per TP group: all processes (-1, or their number); data parallel beside TP is train_hybrid.py's",
    )
    g.add_argument(
        "--sequence_parallel",
        action="store_true",
        help="shard LayerNorm/dropout activations along the sequence "
        "(all-gather + reduce-scatter instead of all-reduce)",
    )
    g.add_argument(
        "--loss_parallel",
        action="store_true",
        help="compute the cross-entropy on vocabulary-sharded logits, never gathering them",
    )
    args = parser.parse_args()
    args.output_dir = args.output_dir or "runs/tp"
    check_core_args(args)

    # ---------------------------------------- Accelerator and layout
    # Accelerate: process group (gloo on CPU, NCCL on GPU), device, mixed precision from the launcher.
    # cpu=True where CUDA is missing: the N processes then join one gloo group (without it, each trains alone).
    # The scheduler counts optimizer steps (step_scheduler_with_optimizer=False), whatever the layout.
    accelerator = make_accelerator(
        args,
        cpu=args.cpu or not torch.cuda.is_available(),
        sharded=True,  # refuses a launch that also asks Accelerate to shard
        step_scheduler_with_optimizer=False,
    )
    dp_shard = 1 if args.tp_size == -1 else -1  # TP: a smaller --tp_size leaves dp groups (refused below)
    layout = Layout.from_degrees(accelerator.num_processes, tp=args.tp_size, dp_shard=dp_shard)  # TP: every rank
    check_tp_layout(layout)  # TP: TP only; data parallel beside TP is train_hybrid.py's
    dp_size = layout.dp  # TP: 1, every rank of the TP group reads the same batch
    grad_accum, global_batch_size = batch_of_step(args, dp_size)  # batch_size x dp_size x accumulation

    # ---------------------------------------- data (checked before anything is written)
    # the built-in data sets (addition, pystdlib, hub, your files), cut to the model's context, in its tokens
    from common.data import load_data
    from common.model import context_length, tokenizer_for

    data = load_data(args, accelerator, context_length(args), tokenizer_for(args))
    train_loader = make_train_loader(data.train, args.batch_size, global_batch_size, args.seed)

    # ---------------------------------------- MODEL: the only lines that name the model (docs/your-model.md)
    set_seed(args.seed)  # Accelerate: the same full model on every rank: init independent of the layout
    # the built-in GPT, or a 🤗 transformers causal LM (--model_name_or_path, --model_config), and its Task:
    # the loss of a micro-batch as (loss_sum, n_targets), the targets it counts, its evaluation and export
    from common.model import language_model

    model, task = language_model(args, data, on_meta=True)  # TP: a 🤗 model on meta, made below in shards
    on_meta = any(p.is_meta for p in model.parameters())  # TP: a 🤗 model waits on meta for its shards
    model = model if on_meta else model.to(accelerator.device)  # TP: only a model with weights moves now
    units = task.units(model)  # the repeated units: --compile
    n_params, model_line = count_parameters(model), task.describe(model)
    # TP: the plan, {module name: style} (above); one rank has nothing to split
    plan = model_tp_plan(model, task, layout, args.sequence_parallel, args.loss_parallel) if layout.tp > 1 else {}
    if plan:  # TP: every key names a module of the model, every flag has a style to act on
        check_tp_plan(model, plan, args.sequence_parallel, args.loss_parallel)  # TP: the plan fits the model, flags
    check_tp_flags(layout, task, args.sequence_parallel, args.loss_parallel)  # TP: the flags fit the layout, data
    resume_path, facts = check_resume_and_output(accelerator, args, model, task, global_batch_size, layout)
    reference = uncut_copy(model, task, args.skip_cut_check)  # the model as built: what the cut must compute
    layout.build_mesh(accelerator.device.type)

    # ---------------------------------------- TP: the strategy
    # A TP group of one rank has nothing to split: the plan would only route every op through
    # DTensor, about 4x DDP's host time per step (docs/benchmarks.md). Like torchtitan, skip it.
    if layout.tp > 1:
        apply_tensor_parallel(model, layout.sub("tp"), plan)  # TP: every weight the plan names becomes a shard
    if on_meta:  # TP: each rank makes only its shards, no rank the whole model (read, or initialised, in slices)
        model.to_empty(device=accelerator.device)
        task.materialize(model)
    if args.compile:
        compile_units(units, accelerator)  # after the TP split

    # ---------------------------------------- optimizer (after sharding: it sees the shards)
    optimizer = make_optimizer(model, args)
    scheduler = make_scheduler(optimizer, args)
    # Accelerate: optimizer/scheduler wrappers (not the model: TP owns it); the loader sharded over the dp ranks
    optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
    train_sampler = train_loader.sampler
    train_loader = shard_loader(train_loader, accelerator, layout)
    lp = loss_parallel() if args.loss_parallel else None  # TP: the loss on vocabulary shards
    check_task_contract(task, model, data.validation, accelerator.device, lp)  # TP: with the loss on vocab shards
    probe_step = partial(tp_forward_backward, accelerator, model, task, dp_size=dp_size)  # TP: the step, on a probe
    probe_step.keywords.update(use_loss_parallel=args.loss_parallel, counts_loss=layout.holds_loss)  # TP: its flags
    cut_line = check_cut(accelerator, model, probe_step, reference, task, data.validation, grad_accum, layout)
    progress = load_checkpoint(accelerator, resume_path, model, optimizer, scheduler)  # step 0 without a checkpoint
    feed = StepFeed(
        accelerator,
        train_loader,
        train_sampler,
        global_batch_size,
        grad_accum,
        progress,
        task.count_targets,
        dp_group=layout.group("dp"),
    )
    feed.seed_dropout(args.seed, layout)  # dropout: each data-parallel rank its own masks, a resume the same ones
    monitor = RunMonitor(accelerator, args, "train_tp", feed, layout.world_size, global_batch_size)
    tp_lines, megatron = tp_start_lines(model, plan, layout, args, task.tokens_per_sample or 1)  # TP: what it splits
    tp_lines += ["each rank made only its shards of the weights (built on meta)"] if on_meta and plan else []  # TP
    costs = sharded_start_line(model, layout, n_params, args.optimizer, accelerator)
    monitor.start(task, model_line, n_params, data, [*tp_lines, costs, cut_line], resume_path, layout)

    # ---------------------------------------- the training loop
    step, last_step = progress["step"], min(args.max_steps, args.stop_at_step or args.max_steps)
    holds_loss = layout.holds_loss  # TP: the ranks of a TP group hold the same loss sum: TP rank 0 counts it
    model.train()
    while step < last_step and not feed.preempted:
        with monitor.timed_step():  # training time: the records, evaluations and checkpoints below are not
            micro_batches, n_global_targets = feed.next_step()
            with monitor.collectives():  # TP: every layer's f/g collectives, inside forward and backward (counted once)
                loss_sum = tp_forward_backward(  # TP: the whole TP group runs the same micro-batches
                    accelerator, model, task, micro_batches, n_global_targets, args.loss_parallel, dp_size, holds_loss
                )
            grad_norm = clip_grad_norm_(model.parameters(), args.max_grad_norm)  # the whole model's norm, every rank
            lr = scheduler.get_last_lr()[0]
            optimizer.step()  # TP: each rank updates its slice of every matrix
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

        if monitor.due(step, "train"):
            loss = (accelerator.reduce(loss_sum, reduction="sum") / n_global_targets).item()  # Accelerate: all-reduce
            monitor.train(step, loss, lr, grad_norm)
        if monitor.due(step, "eval"):  # TP: each sample counted once, by TP rank 0 (layout.holds_loss)
            monitor.eval(step, evaluate(accelerator, model, task, data.validation, args.eval_batch_size, layout))
        if monitor.due(step, "checkpoint") or feed.preempted:  # every rank writes its part (a collective)
            save_checkpoint(accelerator, args, step, feed, model, optimizer, scheduler, facts)
    feed.close()

    # ---------------------------------------- save
    if step == args.max_steps:  # every rank (it gathers what the model holds); the main process writes
        export_model(accelerator, model, task, data_source(args), Path(args.output_dir) / "model", layout)
    costs = sharded_summary(accelerator, layout, n_params, args.optimizer, model, optimizer)
    monitor.summary(step, preempted=feed.preempted, **costs, **megatron)  # TP: with Megatron's count
    accelerator.wait_for_everyone()
    accelerator.end_training()  # Accelerate: closes trackers and destroys the process group


if __name__ == "__main__":
    run_main(main)
