"""The cost figures of the sharded strategies: the bytes each rank really holds (a DTensor counts its
local shard), measured after a step and printed at start, against DDP's and the ideal split."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .costs import ddp_state_bytes, peak_memory_mb


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


def sharded_start_line(model, layout, n_params: int, optimizer_name: str, accelerator) -> str:
    """What each rank holds, printed at start beside DDP's figure. Collective (a gather)."""
    param_bytes = gather_max(accelerator, local_bytes(model.parameters()))
    per_state = 4 if optimizer_name == "adamw" else 2  # parameters, gradients (+ two Adam moments), fp32
    ddp_bytes = ddp_state_bytes(n_params, optimizer_name)["total_bytes"]
    return (
        f"parameters per rank (largest): {param_bytes / 2**20:.2f} MiB "
        f"of the unsharded {4 * n_params / 2**20:.2f} MiB; "
        f"with gradients and optimizer state ~{per_state * param_bytes / 2**20:.2f} MiB "
        f"(DDP: {ddp_bytes / 2**20:.2f} MiB, ideal split over {layout.model_split}: "
        f"{ddp_bytes / layout.model_split / 2**20:.2f} MiB)"
    )


def sharded_summary(accelerator, layout, n_params: int, optimizer_name: str, model, optimizer) -> dict:
    """The cost figures of a sharded run's summary: measured bytes per rank (largest rank)
    against DDP's and the ideal split (the first step's collectives: RunMonitor.summary). Collective
    (gathers)."""
    state_bytes = training_state_bytes(model, optimizer)
    measured = {
        k: gather_max(accelerator, state_bytes.get(k, 0))
        for k in ("param_bytes", "grad_bytes", "optimizer_bytes", "total_bytes")
    }
    ideal = (
        ddp_state_bytes(n_params, optimizer_name)["total_bytes"] / layout.model_split
    )  # DDP's bytes over every different piece
    return {
        "n_params": n_params,
        "layout": layout.describe(),
        "peak_memory_mb_max_rank": round(gather_max(accelerator, peak_memory_mb(accelerator.device)), 1),
        "state_bytes_per_rank_max": measured,
        "ddp_state_bytes_per_rank": ddp_state_bytes(n_params, optimizer_name),
        "ideal_state_bytes_per_rank": round(ideal),
        "state_vs_ideal": round(measured["total_bytes"] / ideal, 4),
        "unsharded_param_bytes": 4 * n_params,
    }
