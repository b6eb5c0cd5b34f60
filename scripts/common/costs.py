"""What a run costs, as its first lines and its summary report it: parameters, peak memory, the
gradient all-reduce of a replicated run (DDP, Local SGD), and what DDP holds per rank, the yardstick
of the sharded strategies (common/sharded_costs.py)."""

from __future__ import annotations

import resource

import torch
import torch.nn as nn


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def peak_memory_mb(device: torch.device) -> float:
    """Peak accelerator memory allocated on CUDA; peak resident memory of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def ring_allreduce_bytes(n_bytes: float, n_ranks: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce: reduce-scatter then all-gather,
    each moving (N-1)/N of the buffer."""
    return 2 * (n_ranks - 1) / n_ranks * n_bytes


def ddp_state_bytes(n_params: int, optimizer_name: str) -> dict:
    """What DDP holds on every rank in fp32: parameters, gradients, and for AdamW two moments
    (plus a 4-byte step count per tensor, ignored here)."""
    optim = 8 * n_params if optimizer_name == "adamw" else 0
    return {
        "param_bytes": 4 * n_params,
        "grad_bytes": 4 * n_params,
        "optimizer_bytes": optim,
        "total_bytes": 8 * n_params + optim,
    }


def replicated_summary(accelerator, n_params: int, allreduce_mib: float) -> dict:
    """The cost figures of a replicated run's summary (DDP, Local SGD): peak memory of the largest
    rank and of all ranks, and the gradient all-reduce per step and rank. Collective (a gather)."""
    peak_mb = accelerator.gather(torch.tensor([peak_memory_mb(accelerator.device)], device=accelerator.device))
    return {
        "n_params": n_params,
        "peak_memory_mb_max_rank": round(peak_mb.max().item(), 1),
        "peak_memory_mb_all_ranks": round(peak_mb.sum().item(), 1),
        "gradient_allreduce_mib_per_step_per_rank": round(allreduce_mib, 3),
    }
