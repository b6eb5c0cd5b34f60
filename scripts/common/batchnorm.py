"""BatchNorm under data parallelism: one set of running statistics for the whole run. Each rank's
drift apart (docs/troubleshooting.md, "BatchNorm: the layouts disagree"), so evaluation, checkpoints,
the export and Local SGD's fusion average them over the ranks first. That changes no training step
(training mode uses the batch's statistics), and averaging now or later is the same (the running ones
are linear in the batch's). --sync_batchnorm, the global micro-batch's statistics: common/sync_batchnorm.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm


def batchnorm_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, _BatchNorm)]


def running_stats(model: nn.Module) -> list[torch.Tensor]:
    """The buffers a forward in training mode updates from its batch: any floating buffer named running_*."""
    return [
        b
        for name, b in model.named_buffers()
        if name.rsplit(".", 1)[-1].startswith("running_") and b.is_floating_point()
    ]


@torch.no_grad()
def average_running_stats(model: nn.Module, group=None) -> None:
    """Collective over `group`: every rank's running statistics become their average, as rank 0's plus the
    mean difference from it (statistics already equal everywhere stay bit for bit)."""
    buffers = running_stats(model)
    if not buffers or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([b.reshape(-1).float() for b in buffers])
    first = flat.clone()
    dist.broadcast(first, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    difference = flat - first
    dist.all_reduce(difference, group=group)
    flat = first + difference / dist.get_world_size(group)
    for b, value in zip(buffers, flat.split([b.numel() for b in buffers])):
        b.copy_(value.view_as(b))


def batchnorm_line(model: nn.Module, dp_size: int, synced: bool) -> str | None:
    """The start line about BatchNorm, when the model has some and there is more than one rank."""
    n = len(batchnorm_layers(model))
    if n == 0 or dp_size == 1:
        return None
    if synced:
        return f"--sync_batchnorm: {n} BatchNorm layer(s) normalise over the global micro-batch ({dp_size} ranks)"
    return (
        f"note: {n} BatchNorm layer(s) normalise over each rank's own micro-batch, not the global one: this run "
        f"differs from one process at the same global batch; --sync_batchnorm normalises over all {dp_size} ranks"
    )
