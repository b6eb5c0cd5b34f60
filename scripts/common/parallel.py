"""Every strategy, applied once, from outside the model, with PyTorch's composable APIs.

The order is fixed (torchtitan's): split into pipeline stages, then tensor parallel, then
activation checkpointing, then FSDP/HSDP. The single-strategy scripts and train_hybrid.py call
these same functions; none of them exists twice.

    split_pipeline(model, layout)        keep this rank's layers; stage views   (PP)
    apply_tensor_parallel(model, mesh)   Megatron column/row split per block    (TP)
    apply_activation_checkpointing(model)  recompute each block in backward
    apply_fsdp(model, chunks, mesh)      one FSDP unit per block + the root     (FSDP / HSDP)
    build_schedule(chunks, ...)          the pipeline schedule                  (PP)

Plus what the strategies share: gradient clipping over sharded gradients, the exact byte count
of what each rank holds, and a counter of the collectives one step runs.
"""
from __future__ import annotations

import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, PrepareModuleOutput, RowwiseParallel, SequenceParallel, parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode

from .layout import Layout
from .model import GPT

# ==================================================================================== PP
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "zero_bubble")  # several stages per rank


def stage_layers(n_layer: int, n_stages: int, split_points: list[int] | None = None) -> list[range]:
    """Layers of each stage: balanced by count (earlier stages take the remainder), or cut
    before each layer in `split_points`."""
    if split_points:
        cuts = [0, *split_points, n_layer]
    else:
        base, extra = divmod(n_layer, n_stages)
        cuts = [0]
        for s in range(n_stages):
            cuts.append(cuts[-1] + base + (1 if s < extra else 0))
    return [range(a, b) for a, b in zip(cuts, cuts[1:], strict=False)]


def stages_of_rank(pp_rank: int, pp_size: int, stages_per_rank: int) -> list[int]:
    """Looped placement: rank r holds stages r, r + pp, r + 2pp ... (what the interleaved
    schedules expect)."""
    return [pp_rank + k * pp_size for k in range(stages_per_rank)]


class PipelineChunk(nn.Module):
    """One pipeline stage: a view onto some layers of this rank's model. It owns nothing: its
    parts are the model's modules, so the model's parameter names (and checkpoints) are
    untouched. The first stage embeds, the last applies the final norm and head, with the
    model's own code (GPT.embed / GPT.head)."""

    def __init__(self, model: GPT, layers: range, is_first: bool, is_last: bool):
        super().__init__()
        self.tok_emb, self.pos_emb, self.drop = (model.tok_emb, model.pos_emb, model.drop) if is_first else (None, None, None)
        self.blocks = nn.ModuleList(model.blocks[str(i)] for i in layers)
        self.ln_f, self.lm_head = (model.ln_f, model.lm_head) if is_last else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:
            x = GPT.embed(self, x)  # token ids -> hidden states
        for block in self.blocks:
            x = block(x)
        if self.lm_head is not None:
            x = GPT.head(self, x)  # hidden states -> logits
        return x


def split_pipeline(model: GPT, layout: Layout, stages_per_rank: int = 1, split_points: list[int] | None = None) -> list[PipelineChunk]:
    """Cut the model into pp x stages_per_rank stages; this rank keeps only its stages' layers
    (the others are deleted, so their memory is freed) and gets one view per stage."""
    n_stages = layout.pp * stages_per_rank
    layers = stage_layers(model.config.n_layer, n_stages, split_points)
    mine = stages_of_rank(layout.pp_rank, layout.pp, stages_per_rank)
    keep = {i for s in mine for i in layers[s]}
    for i in range(model.config.n_layer):
        if i not in keep:
            del model.blocks[str(i)]
    if 0 not in mine:
        model.tok_emb = model.pos_emb = None
    if n_stages - 1 not in mine:
        model.ln_f = model.lm_head = None
    return [PipelineChunk(model, layers[s], is_first=s == 0, is_last=s == n_stages - 1) for s in mine]


class TimedStage:
    """Mixin for PipelineStage that measures what the schedule costs this rank: the time it
    computes (forward, backward, weight gradients), the most micro-batches whose activations
    it holds at once, and the bytes autograd saves for one micro-batch's backward."""

    def reset_counters(self) -> None:
        self.busy_s, self.max_in_flight = 0.0, 0
        if not hasattr(self, "activation_bytes"):
            self.activation_bytes = None

    def forward_one_chunk(self, *args, **kwargs):
        start = time.perf_counter()
        measure = self.activation_bytes is None and torch.is_grad_enabled()
        storages: dict[int, int] = {}

        def pack(t):  # every tensor autograd keeps for backward, each storage counted once
            local = t.to_local() if isinstance(t, DTensor) else t
            try:
                storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
            except RuntimeError:  # a tensor without its own storage (a wrapper subclass): count its size
                storages[id(t)] = local.numel() * local.element_size()
            return t

        try:
            if measure:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    return super().forward_one_chunk(*args, **kwargs)
            return super().forward_one_chunk(*args, **kwargs)
        finally:
            self.busy_s += time.perf_counter() - start
            if torch.is_grad_enabled():
                self.max_in_flight = max(self.max_in_flight, len(self.fwd_cache))
            if measure:
                self.activation_bytes = sum(storages.values())

    def backward_one_chunk(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return super().backward_one_chunk(*args, **kwargs)
        finally:
            self.busy_s += time.perf_counter() - start

    def backward_weight_one_chunk(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return super().backward_weight_one_chunk(*args, **kwargs)
        finally:
            self.busy_s += time.perf_counter() - start


def build_schedule(chunks: list[PipelineChunk], layout: Layout, schedule: str, n_microbatches: int, loss_fn, device: torch.device):
    """One PipelineStage per chunk and the schedule that runs them. `scale_grads=False`: the
    loss function already divides by the global batch's target count (pitfall 9)."""
    from torch.distributed.pipelining import PipelineStage, schedules

    class Stage(TimedStage, PipelineStage):
        pass

    stages_per_rank = len(chunks)
    mine = stages_of_rank(layout.pp_rank, layout.pp, stages_per_rank)
    stages = [Stage(chunk, stage_index=s, num_stages=layout.pp * stages_per_rank, device=device, group=layout.group("pp")) for chunk, s in zip(chunks, mine, strict=True)]
    for stage in stages:
        stage.reset_counters()
    if schedule in MULTI_STAGE_SCHEDULES:
        cls = schedules.ScheduleInterleaved1F1B if schedule == "interleaved_1f1b" else schedules.ScheduleInterleavedZeroBubble
        return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False), stages
    cls = schedules.ScheduleGPipe if schedule == "gpipe" else schedules.Schedule1F1B
    return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False), stages


def bubble_theory(pp: int, n_microbatches: int, stages_per_rank: int = 1) -> float:
    """Idle fraction of GPipe/1F1B: (p-1)/(m+p-1); interleaving v stages per rank divides the
    bubble's length by v: (p-1)/(v*m+p-1)."""
    return (pp - 1) / (stages_per_rank * n_microbatches + pp - 1)


# ==================================================================================== TP
def tensor_parallel_plan(model: GPT, sequence_parallel: bool, loss_parallel: bool) -> dict:
    """Megatron's split, as a parallelize_module plan (only for the parts this rank holds).

    Per block: q/k/v column-wise (each rank computes n_head/tp heads), o_proj row-wise;
    up_proj column-wise, down_proj row-wise. One all-reduce after o_proj and one after
    down_proj in forward (Megatron's g), one each at the block's inputs in backward (f).
    With sequence parallel the norms work on a slice of the sequence, and each all-reduce
    becomes an all-gather before attention/MLP plus a reduce-scatter after them.
    """
    seq = Shard(1)
    plan = {}
    if model.tok_emb is not None:  # vocab-parallel: each rank holds vocab/tp rows; partial sums are reduced
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq if sequence_parallel else Replicate())
        if sequence_parallel:  # positions of this rank's sequence slice, to add to its token slice
            plan["pos_emb"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
    for name in model.blocks:
        b = f"blocks.{name}"
        plan.update({
            f"{b}.attn.q_proj": ColwiseParallel(), f"{b}.attn.k_proj": ColwiseParallel(), f"{b}.attn.v_proj": ColwiseParallel(),
            f"{b}.attn.o_proj": RowwiseParallel(output_layouts=seq if sequence_parallel else Replicate()),
            f"{b}.mlp.up_proj": ColwiseParallel(),
            f"{b}.mlp.down_proj": RowwiseParallel(output_layouts=seq if sequence_parallel else Replicate()),
        })
        # Attention and MLP take their input as one replicated DTensor (all-gathered from the sequence
        # slices under SP): q, k and v share it, so backward reduces its gradient once, not 3 times.
        block_input = seq if sequence_parallel else Replicate()
        plan.update({f"{b}.attn": PrepareModuleInput(input_layouts=(block_input,), desired_input_layouts=(Replicate(),)),
                     f"{b}.mlp": PrepareModuleInput(input_layouts=(block_input,), desired_input_layouts=(Replicate(),))})
        if sequence_parallel:
            plan.update({f"{b}.ln_1": SequenceParallel(), f"{b}.ln_2": SequenceParallel()})
    if model.lm_head is not None:
        if sequence_parallel:
            plan["ln_f"] = SequenceParallel()
        # loss parallel: keep the logits sharded over the vocabulary; the loss is computed on the shards
        plan["lm_head"] = ColwiseParallel(input_layouts=seq if sequence_parallel else Replicate(),
                                          output_layouts=Shard(-1) if loss_parallel else Replicate(), use_local_output=not loss_parallel)
    return plan


def apply_tensor_parallel(model: GPT, tp_mesh, sequence_parallel: bool = False, loss_parallel: bool = False) -> None:
    parallelize_module(model, tp_mesh, tensor_parallel_plan(model, sequence_parallel, loss_parallel))


# ==================================================================================== FSDP
def apply_activation_checkpointing(model: GPT) -> None:
    """Recompute each block's activations in backward instead of storing them. The composable
    `checkpoint` adds no wrapper module, so parameter names stay those of the full model."""
    from torch.distributed._composable import checkpoint

    for block in model.blocks.values():
        checkpoint(block)


def fsdp_mixed_precision(mixed_precision: str):
    """bf16 parameters for compute, fp32 gradient reduction and fp32 master weights."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mixed_precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_fsdp(model: GPT, roots: list[nn.Module], fsdp_mesh, mixed_precision: str = "no", reshard_after_forward: bool = True, cpu_offload: bool = False) -> None:
    """One FSDP unit per block, then each root (the whole model, or each pipeline stage) holding
    what is left: embeddings, final norm, head. A unit's parameters are all-gathered just
    before its forward and again before its backward, and its gradients reduce-scattered
    right after its backward, so only one block is ever unsharded at a time."""
    import warnings

    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    # Under TP the root returns the logits as a view of a DTensor's local tensor. FSDP warns that an
    # in-place op on that view would skip its hooks; the loss only reads the logits, never writes them.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    kwargs = {"mesh": fsdp_mesh, "mp_policy": fsdp_mixed_precision(mixed_precision),
              "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy()}
    for block in model.blocks.values():
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
    for root in roots:
        fully_shard(root, reshard_after_forward=reshard_after_forward, **kwargs)


# ==================================================================================== shared
@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, pp_group=None) -> torch.Tensor:
    """Clip the global gradient norm when gradients are sharded (DTensor) and/or split over
    pipeline stages; `max_norm` inf only measures. Returns the norm before clipping, the same on
    every rank.

    A DTensor gradient may come out of backward in another placement than its parameter (a
    replicated LayerNorm weight under sequence parallel gets a Partial sum from each sequence
    slice): it is first brought to the parameter's placement, which the optimizer needs anyway.
    Then each rank sums the squares of its local pieces; pieces sharded over a mesh dimension
    are summed over it, replicated ones counted once; then the pipeline stages are summed."""
    parameters = [p for p in parameters if p.grad is not None]
    for p in parameters:
        if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)
    device = parameters[0].grad.device
    buckets: dict[tuple, torch.Tensor] = defaultdict(lambda: torch.zeros((), dtype=torch.float64, device=device))
    for p in parameters:
        if isinstance(p.grad, DTensor):
            sharded_dims = tuple(i for i, placement in enumerate(p.placements) if not placement.is_replicate())  # Shard or _StridedShard (FSDP x TP)
            buckets[(p.device_mesh, sharded_dims)] += p.grad.to_local().double().pow(2).sum()
        else:
            buckets[(None, ())] += p.grad.double().pow(2).sum()
    total = torch.zeros((), dtype=torch.float64, device=device)
    for (mesh, sharded_dims), squares in buckets.items():
        for dim in sharded_dims:
            dist.all_reduce(squares, group=mesh.get_group(dim))
        total += squares
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total, group=pp_group)
    norm = total.sqrt().float()
    if max_norm != float("inf"):
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in parameters:
            (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).mul_(scale.to(p.grad.dtype))
    return norm


def local_bytes(tensors) -> int:
    """Bytes this rank really holds: a DTensor counts its local shard only."""
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)


def training_state_bytes(model: nn.Module, optimizer) -> dict:
    """Exact per-rank bytes of parameters, gradients and optimizer state (after a step, when the
    gradients and Adam's moments exist)."""
    opt = getattr(optimizer, "optimizer", optimizer)
    params = [p for p in model.parameters()]
    optim_tensors = [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    figures = {"param_bytes": local_bytes(params), "grad_bytes": local_bytes(p.grad for p in params if p.grad is not None),
               "optimizer_bytes": local_bytes(optim_tensors)}
    figures["total_bytes"] = sum(figures.values())
    return figures


def ddp_state_bytes(n_params: int, optimizer_name: str) -> dict:
    """What DDP holds on every rank in fp32: parameters, gradients, and for AdamW two moments
    (plus a 4-byte step count per tensor, ignored here)."""
    optim = 8 * n_params if optimizer_name == "adamw" else 0
    return {"param_bytes": 4 * n_params, "grad_bytes": 4 * n_params, "optimizer_bytes": optim, "total_bytes": 8 * n_params + optim}


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives run while it is active, forward and backward, and the size of the
    full buffer each works on (the unsharded tensor of an all-gather or reduce-scatter): the
    DTensor collectives of TP (functional ops) and the c10d ops of FSDP, pipeline send/recv and
    plain torch.distributed calls. Used for one measured step."""

    NAMES = {"all_reduce": "all_reduce", "allreduce_": "all_reduce", "all_gather_into_tensor": "all_gather", "_allgather_base_": "all_gather",
             "allgather_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
             "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter", "reduce_scatter_tensor_coalesced_": "reduce_scatter",
             "all_to_all_single": "all_to_all", "broadcast_": "broadcast", "send": "send", "recv_": "recv"}

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if func.namespace in ("_c10d_functional", "c10d") and name in self.NAMES:
            kind = self.NAMES[name]
            tensors = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(t, torch.Tensor)]
            buffer = max((t.nbytes for t in tensors), default=0)  # the full (unsharded) buffer of the collective
            if func.namespace == "_c10d_functional" and kind == "all_gather":
                buffer *= args[1]  # functional all-gather gets the shard and the group size
            self.calls[kind] += 1
            self.bytes[kind] += buffer
        return func(*args, **(kwargs or {}))

    def report(self) -> dict:
        return {kind: {"calls": self.calls[kind], "mib": round(self.bytes[kind] / 2**20, 4)} for kind in sorted(self.calls)}
