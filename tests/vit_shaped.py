"""A model of one's own with a Vision Transformer's shape, built without timm (issue 56): patches of each
sample embedded, a class token, learned positions, blocks in an `nn.Sequential` (timm's `blocks`), each
with ONE fused qkv Linear, drop path and dropout, and a head on the class token. It regresses y from x
like docs/your-model.md's MLP, on the same synthetic data (rows [x (16), y (1)]): x is cut into
4 patches of 4 features.

Tests copy a lesson, replace its data and MODEL sections with `DATA` and `MODEL` below (the MODEL
section's lines as a learner writes them) and put this file beside the copy."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from common.task import Task


class DropPath(nn.Module):
    """Stochastic depth (timm's): a sample's whole branch dropped with probability p in training."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        keep = torch.rand(x.shape[0], *([1] * (x.dim() - 1)), device=x.device) >= self.p
        return x * keep / (1 - self.p)


class Attention(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(width, 3 * width)  # fused: q, k, v in one weight, as timm's
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float, drop_path: float):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = Attention(width, heads, dropout)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.drop_path = DropPath(drop_path)

    def forward(self, x):
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class ViTShaped(nn.Module):
    def __init__(self, n_in=16, patch=4, width=32, heads=4, depth=2, dropout=0.0, drop_path=0.0):
        super().__init__()
        self.patch = patch
        self.patch_embed = nn.Linear(patch, width)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, width))
        self.pos_embed = nn.Parameter(torch.randn(1, n_in // patch + 1, width) * 0.02)
        self.blocks = nn.Sequential(*(Block(width, heads, dropout, drop_path) for _ in range(depth)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        x = self.patch_embed(x.view(x.shape[0], -1, self.patch))
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = self.blocks(x)
        return self.head(self.norm(x[:, 0]))  # the class token


class ViTTask(Task):
    name = "vit_regression"
    units_path = "blocks"  # an nn.Sequential, as timm's
    tokens_per_sample = None

    def inputs(self, batch):
        return (batch[0],)

    def targets(self, batch):
        return batch[1]

    def count_targets(self, batch):
        return batch[1].numel()

    def loss(self, outputs, targets):
        return F.mse_loss(outputs.float(), targets, reduction="sum"), targets.numel()


# the copy's data section: the same synthetic regression as docs/your-model.md's
DATA = """\
    from types import SimpleNamespace

    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(0)  # your batches; a fixed seed: the same samples on every rank
    x = torch.randn(2304, 16, generator=g)
    y = torch.sin(x[:, :8]).sum(1, keepdim=True) + 0.1 * torch.randn(2304, 1, generator=g)
    train, validation = TensorDataset(x[:2048], y[:2048]), TensorDataset(x[2048:], y[2048:])  # rows (x, y)
    data = SimpleNamespace(train=train, validation=validation, name="synthetic regression")
"""
# the copy's MODEL section: this file beside the copy
MODEL = """\
    from vit_shaped import ViTShaped, ViTTask  # your model and its Task, beside this copy

    model, task = ViTShaped(), ViTTask()
"""
