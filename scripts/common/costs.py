"""What a run costs, as its first lines and summary report it: parameters, peak memory, a replicated
run's all-reduce (DDP, Local SGD). What DDP holds per rank, the sharded ones' yardstick: sharded_costs.py."""

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
    """Bytes each rank sends in a ring all-reduce: reduce-scatter, then all-gather, (N-1)/N each."""
    return 2 * (n_ranks - 1) / n_ranks * n_bytes


def replicated_summary(accelerator, n_params: int, allreduce_mib: float) -> dict:
    """Collective: a replicated run's summary figures (peak memory, the all-reduce per step and rank)."""
    peak_mb = accelerator.gather(torch.tensor([peak_memory_mb(accelerator.device)], device=accelerator.device))
    return {
        "n_params": n_params,
        "peak_memory_mb_max_rank": round(peak_mb.max().item(), 1),
        "peak_memory_mb_all_ranks": round(peak_mb.sum().item(), 1),
        "gradient_allreduce_mib_per_step_per_rank": round(allreduce_mib, 3),
    }
