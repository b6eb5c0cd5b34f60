"""BatchNorm under data parallelism: the statistics of the global micro-batch, and one set of
running statistics for the whole run.

Plain BatchNorm normalises over each rank's own micro-batch, so 2 ranks x 32 samples train another
model than 1 rank x 64 (docs/troubleshooting.md, "BatchNorm: the layouts disagree"), and each rank's
running statistics (the buffers that evaluation uses) drift apart:

    --sync_batchnorm    every BatchNorm layer normalises over the global micro-batch: the sums,
                        sums of squares and counts are all-reduced over the data-parallel ranks,
                        with their backward (torch's SyncBatchNorm on GPUs; on CPUs, where torch
                        has no kernels for it, the all-reduce below)
    average_running_stats(model, group)   the ranks' running statistics averaged: evaluation,
                        checkpoints and the export (common/evaluation.py, common/checkpoint.py) do
                        it under every strategy, and Local SGD's fusion: they all use one set

Averaging the running statistics now or later gives the same result, because each is an
exponential moving average (linear) of the batch statistics, and in training mode BatchNorm uses
the batch's statistics, never the running ones: averaging changes no training step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm


def batchnorm_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, _BatchNorm)]


def running_stats(model: nn.Module) -> list[torch.Tensor]:
    """The buffers that a forward in training mode updates from its own batch: running_mean and
    running_var of every normalisation layer that tracks them (any floating buffer named running_*)."""
    return [
        b
        for name, b in model.named_buffers()
        if name.rsplit(".", 1)[-1].startswith("running_") and b.is_floating_point()
    ]


@torch.no_grad()
def average_running_stats(model: nn.Module, group=None) -> None:
    """Collective over `group` (None: all ranks): every rank's running statistics become their
    average. Computed as rank 0's value plus the mean difference from it, so statistics that are
    already equal everywhere (DDP's, one model loaded by every process) stay bit for bit what they
    are. Nothing to do (no collective) for a model without running statistics."""
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


class AllReduceSum(torch.autograd.Function):
    """A sum over the ranks whose backward is a sum over the ranks too: each rank's loss depends on
    every rank's statistics, so the gradient of a statistic is the sum of every rank's."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class GlobalBatchNorm(_BatchNorm):
    """BatchNorm over the micro-batches of every rank of `group`: the mean and the variance are
    all-reduced (two small all-reduces per layer and forward, and their two in backward), so the
    layer computes what one process computes on the global micro-batch. Same parameters and
    buffers as the layer it replaces, so checkpoints and exports do not change."""

    def __init__(self, layer: _BatchNorm, group=None):
        super().__init__(layer.num_features, layer.eps, layer.momentum, layer.affine, layer.track_running_stats)
        self.weight, self.bias = layer.weight, layer.bias  # the same Parameters: the optimizer keeps them
        self.running_mean, self.running_var = layer.running_mean, layer.running_var
        self.num_batches_tracked = layer.num_batches_tracked
        self.group = group
        self._check_dim = layer._check_input_dim

    def _check_input_dim(self, x):
        self._check_dim(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if not (self.training or not self.track_running_stats):  # evaluation: the running statistics
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        dims = [0, *range(2, x.dim())]  # all but the channels
        shape = [1, -1] + [1] * (x.dim() - 2)
        x, dtype = x.float(), x.dtype  # the statistics in fp32, whatever the compute dtype
        local = torch.cat([x.sum(dims), x.new_tensor([x.numel() / x.size(1)])])
        total = AllReduceSum.apply(local, self.group)  # the sums and the count of every rank
        count, mean = total[-1], total[:-1] / total[-1]
        centered = x - mean.view(shape)
        var = AllReduceSum.apply(centered.pow(2).sum(dims), self.group) / count  # two passes: exact
        if self.training and self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked += 1
                momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                self.running_mean.lerp_(mean.detach(), momentum)
                self.running_var.lerp_(var.detach() * count / (count - 1), momentum)  # unbiased, as torch's
        out = centered * torch.rsqrt(var + self.eps).view(shape)
        out = out * self.weight.view(shape) + self.bias.view(shape) if self.affine else out
        return out.to(dtype)


def sync_batchnorm(model: nn.Module, device: torch.device, group=None) -> int:
    """--sync_batchnorm: every BatchNorm layer of `model` (in place) normalises over the data-parallel
    ranks of `group`. Returns how many layers it replaced."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, _BatchNorm) and not isinstance(child, (GlobalBatchNorm, nn.SyncBatchNorm)):
                if device.type == "cpu":
                    synced = GlobalBatchNorm(child, group)  # torch's SyncBatchNorm has no CPU kernels
                else:
                    synced = nn.SyncBatchNorm.convert_sync_batchnorm(child, group)
                setattr(parent, name, synced)
                replaced += 1
    return replaced
