"""A model of one's own for train_cp.py, written for tests/test_cp.py: neither the built-in GPT nor a 🤗
model. Its Task implements only the contract's two CP methods (set_attention, forward_at): no config the
script could read."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from common.causal_lm import CausalLMTask


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.attention = None  # None: its own causal SDPA

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.attention is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = self.attention(q, k, v, dropout_p=0.0)
        x = x + self.out(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, context: int, vocab: int = 256, width: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.layers = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids, positions=None):
        positions = torch.arange(ids.shape[1], device=ids.device) if positions is None else positions
        x = self.tokens(ids) + self.positions(positions)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class TinyLMTask(CausalLMTask):
    units_path = "layers"

    def set_attention(self, model, attention):
        for layer in model.layers:
            layer.attention = attention

    def forward_at(self, model, input_ids, positions):
        return model(input_ids, positions)


def build(data):
    return TinyLM(context=data.seq_len), TinyLMTask(data.seq_len, data.task)
