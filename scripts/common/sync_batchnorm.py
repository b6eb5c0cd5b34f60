"""--sync_batchnorm: every BatchNorm layer normalises over the global micro-batch, so 2 ranks x 32
samples train the model that 1 rank x 64 trains (docs/troubleshooting.md, "BatchNorm: the layouts
disagree"). The sums, sums of squares and counts are all-reduced over the data-parallel ranks, with
their backward: torch's SyncBatchNorm on GPUs; on CPUs, where torch has no kernels for it
(`aten::batch_norm_stats` is CUDA-only), GlobalBatchNorm below."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm


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
