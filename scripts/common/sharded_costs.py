"""The cost figures of the sharded strategies: the bytes each rank really holds (a DTensor counts its
local shard), measured after a step and printed at start, against DDP's and the ideal split."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .costs import peak_memory_mb


def ddp_state_bytes(n_params: int, optimizer_name: str, muon_share: float = 0.0, n_trained: int | None = None) -> dict:
    """What DDP holds on every rank in fp32: parameters, gradients, and for AdamW two moments
    (plus a 4-byte step count per tensor, ignored here); Muon keeps one (its momentum) for the
    `muon_share` of the model's values it takes, AdamW's two for the rest. Gradients and state exist
    for the `n_trained` values that train (default: all; LoRA: the adapters)."""
    n_trained = n_params if n_trained is None else n_trained
    optim = {"adamw": 8 * n_trained, "muon": round(8 * n_trained - 4 * muon_share * n_params)}.get(optimizer_name, 0)
    return {
        "param_bytes": 4 * n_params,
        "grad_bytes": 4 * n_trained,
        "optimizer_bytes": optim,
        "total_bytes": 4 * n_params + 4 * n_trained + optim,
    }


def trained_numel(model) -> int:
    """Values that train, counted whole (a DTensor's global size): every one, or under LoRA the adapters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def muon_share(model, optimizer_name: str) -> float:
    """The share of this rank's model values Muon takes (0 unless --optimizer muon)."""
    if optimizer_name != "muon":
        return 0.0
    from .muon import muon_numel  # only a Muon run

    return muon_numel(model) / max(1, sum(p.numel() for p in model.parameters()))


def gather_max(accelerator, value: float) -> float:
    return (
        accelerator.gather(torch.tensor([float(value)], device=accelerator.device)).max().item()
    )  # Accelerate: all-gather


def local_bytes(tensors) -> int:
    """Bytes this rank really holds: a DTensor counts its local shard only."""
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)


def training_state_bytes(model: nn.Module, optimizer) -> dict:
    """Exact per-rank bytes of parameters, gradients and optimizer state (after a step, when Adam's
    moments exist). A gradient is the same shard as its parameter: it is counted as such (between
    steps, zero_grad has freed it)."""
    opt = getattr(optimizer, "optimizer", optimizer)
    params = list(model.parameters())
    optim_tensors = [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    figures = {
        "param_bytes": local_bytes(params),
        "grad_bytes": local_bytes(p for p in params if p.requires_grad),
        "optimizer_bytes": local_bytes(optim_tensors),
    }
    figures["total_bytes"] = sum(figures.values())
    return figures


def unsharded_grad_bytes(model: nn.Module) -> int:
    """fp32 bytes of this rank's gradients gathered over FSDP's mesh dimensions (dp_shard, dp_shard_cp:
    the mesh dimensions named dp*) but still cut by the others (tp, ep): what FSDP's no_sync keeps
    unsharded through an accumulation window (fp32: the reduce dtype under bf16 too)."""
    total = 0
    for p in model.parameters():
        if not p.requires_grad:
            continue
        numel = p.numel()  # a DTensor's global size
        if isinstance(p, DTensor):
            names = p.device_mesh.mesh_dim_names or ("",) * p.device_mesh.ndim
            for i, placement in enumerate(p.placements):
                if placement.is_shard() and not names[i].startswith("dp"):
                    numel //= p.device_mesh.size(i)  # TP / EP cuts stay
        total += 4 * numel
    return total


def accumulation_figures(model, accelerator, grad_accum: int, unsharded_accumulation: bool) -> dict:
    """How the gradients of an accumulation window are kept: sharded (a reduce-scatter per unit and
    micro-batch: torchtitan's default) or, with --unsharded_accumulation, whole until the window's last
    micro-batch (one reduce-scatter per unit and step). Collective (a gather)."""
    held = gather_max(accelerator, unsharded_grad_bytes(model)) if unsharded_accumulation else 0
    return {
        "micro_batches": grad_accum,
        "gradients": "unsharded" if unsharded_accumulation else "sharded",
        "reduce_scatters_per_unit_and_step": 1 if unsharded_accumulation else grad_accum,
        "unsharded_grad_bytes_per_rank_max": round(held),
    }


def sharded_start_line(
    model, layout, n_params: int, optimizer_name: str, accelerator, grad_accum: int = 1, unsharded_accumulation=False
) -> str:
    """What each rank holds, printed at start beside DDP's figure; with gradient accumulation, how its
    gradients are kept through the window. Collective (a gather)."""
    param_bytes = gather_max(accelerator, local_bytes(model.parameters()))
    trained_bytes = gather_max(accelerator, local_bytes(p for p in model.parameters() if p.requires_grad))  # LoRA
    share = muon_share(model, optimizer_name)
    # gradients (+ two Adam moments; Muon: one for its share), fp32, of what trains
    per_state = {"adamw": 3, "muon": 3 - share}.get(optimizer_name, 1)
    ddp_bytes = ddp_state_bytes(n_params, optimizer_name, share, trained_numel(model))["total_bytes"]
    line = (
        f"parameters per rank (largest): {param_bytes / 2**20:.2f} MiB "
        f"of the unsharded {4 * n_params / 2**20:.2f} MiB; "
        f"with gradients and optimizer state ~{(param_bytes + per_state * trained_bytes) / 2**20:.2f} MiB "
        f"(DDP: {ddp_bytes / 2**20:.2f} MiB, ideal split over {layout.model_split}: "
        f"{ddp_bytes / layout.model_split / 2**20:.2f} MiB)"
    )
    if grad_accum > 1 and unsharded_accumulation:
        held = accumulation_figures(model, accelerator, grad_accum, True)["unsharded_grad_bytes_per_rank_max"]
        line += (
            f"; --unsharded_accumulation: + {held / 2**20:.2f} MiB of unsharded gradients held through the "
            f"{grad_accum} micro-batches, one reduce-scatter per unit and step"
        )
    elif grad_accum > 1:
        line += f"; gradients stay sharded through the {grad_accum} micro-batches (a reduce-scatter per unit and each)"
    return line


def sharded_summary(
    accelerator,
    layout,
    n_params: int,
    optimizer_name: str,
    model,
    optimizer,
    grad_accum=1,
    unsharded_accumulation=False,
) -> dict:
    """The cost figures of a sharded run's summary: measured bytes per rank (largest rank)
    against DDP's and the ideal split (the first step's collectives: RunMonitor.summary); with gradient
    accumulation, how the window keeps its gradients. Collective (gathers)."""
    state_bytes = training_state_bytes(model, optimizer)
    measured = {
        k: gather_max(accelerator, state_bytes.get(k, 0))
        for k in ("param_bytes", "grad_bytes", "optimizer_bytes", "total_bytes")
    }
    ddp = ddp_state_bytes(n_params, optimizer_name, muon_share(model, optimizer_name), trained_numel(model))
    ideal = ddp["total_bytes"] / layout.model_split  # DDP's bytes over every different piece
    return {
        "n_params": n_params,
        "layout": layout.describe(),
        "peak_memory_mb_max_rank": round(gather_max(accelerator, peak_memory_mb(accelerator.device)), 1),
        "state_bytes_per_rank_max": measured,
        "ddp_state_bytes_per_rank": ddp,
        "ideal_state_bytes_per_rank": round(ideal),
        "state_vs_ideal": round(measured["total_bytes"] / ideal, 4),
        "unsharded_param_bytes": 4 * n_params,
        **(
            {"gradient_accumulation": accumulation_figures(model, accelerator, grad_accum, unsharded_accumulation)}
            if grad_accum > 1
            else {}
        ),
    }


def ulysses_bytes_per_layer(micro_batch: int, seq_len: int, cp: int, q_width: int, kv_width: int, elem: int) -> dict:
    """Ulysses' all-to-alls (train_cp.py --cp_impl ulysses) per rank, layer and micro-batch: the buffers each
    rank hands to all_to_all_single, every one micro_batch x seq_len/cp tokens wide. Forward: q, k and v in
    (to head shards) and the output back (q's width); backward the same four, of their gradients. (cp-1)/cp
    of each buffer leaves the rank (`leaves`); the rest stays. `elem`: bytes per value (4 fp32, 2 bf16)."""
    one = micro_batch * (seq_len // cp) * elem
    forward = one * (q_width + 2 * kv_width + q_width)
    return {"forward": forward, "backward": forward, "calls": 8, "leaves": (cp - 1) / cp}
