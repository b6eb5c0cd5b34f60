"""One GPT-style decoder-only transformer, used unchanged by every strategy.

The model knows nothing about parallelism. Strategies are applied from outside
(torchtitan's way), which is why its parts are laid out to be easy to cut:

    GPT
    ├── tok_emb   nn.Embedding(vocab, d)        token embedding   (TP: vocab-parallel)
    ├── pos_emb   nn.Embedding(block_size, d)   learned positions
    ├── blocks    nn.ModuleDict{"0".."L-1": Block}  keyed by layer number: PP splits here, names survive
    │     Block: x + attn(ln_1(x)); x + mlp(ln_2(x))      (pre-LayerNorm)
    │       attn: q_proj k_proj v_proj (TP: column-wise, heads split) -> SDPA -> o_proj (row-wise)
    │       mlp:  up_proj (column-wise) -> GELU -> down_proj (row-wise)
    ├── ln_f      final LayerNorm
    └── lm_head   nn.Linear(d, vocab)           (TP: column-wise; not tied to tok_emb)

Attention reshapes with `head_dim`, never `n_head`, so a block whose q/k/v were
sharded column-wise runs on its local heads without knowing it. A pipeline stage keeps
only its own parts: the embeddings, blocks, or norm and head it does not own are removed
(set to None / deleted), and every remaining parameter keeps its full-model name
(`blocks.3.mlp.up_proj.weight`), which is what lets checkpoints move between layouts.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .causal_lm import CausalLMTask, document_causal_mask, documents_of
from .presets import GPTConfig


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0, documents: torch.Tensor | None = None
) -> torch.Tensor:
    """The attention of every block: causal SDPA over (batch, heads, tokens, head_dim); with `documents`
    (batch, tokens) ids (--document_mask), within each token's own document. Replaceable: context
    parallelism installs its ring attention in its place (GPTTask.set_attention)."""
    if documents is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=document_causal_mask(documents), dropout_p=dropout_p)


class CausalSelfAttention(nn.Module):
    attention = staticmethod(causal_attention)  # an instance's own `attention` replaces it (Task.set_attention)

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.o_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        # (B, T, heads, head_dim) -> (B, heads, T, head_dim); `-1` = however many heads this rank holds
        q, k, v = (
            proj(x).view(B, T, -1, self.head_dim).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        dropout_p = self.dropout if self.training else 0.0
        if documents is None:
            y = self.attention(q, k, v, dropout_p=dropout_p)
        else:
            y = self.attention(q, k, v, dropout_p=dropout_p, documents=documents)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.up_proj = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.down_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int = 0):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = moe_mlp(cfg, layer) if cfg.is_moe_block(layer) else MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln_1(x), documents=documents))
        return x + self.drop(self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layer)})
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.reset_parameters()

    def get_output_embeddings(self) -> nn.Module:
        """The output head (🤗's name for it): --optimizer muon keeps it on AdamW."""
        return self.lm_head

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02), residual projections scaled by 1/sqrt(2L). Seed first: every
        rank must build the same full model before any strategy shards it."""
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif "ln" in name:
                nn.init.ones_(p)
            elif name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * self.config.n_layer))
            else:
                nn.init.normal_(p, std=0.02)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Returns logits (B, T, vocab). The loss lives outside (`GPTTask.loss`), so that
        strategies can normalise it over the whole global batch. `positions`: the tokens' real
        places, (T,) in the sequence (default 0..T-1; context parallelism passes a rank's slice) or
        (B, T) in their documents (--document_mask's position_ids, which then mask the attention by
        document); `documents`: the (B, T) ids of the whole sequences (context parallelism's ring)."""
        x = self.embed(input_ids, positions)
        if documents is None and positions is not None and positions.dim() == 2:
            documents = documents_of(positions)
        for block in self.blocks.values():
            x = block(x, documents=documents)
        return self.head(x)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        positions = positions.expand(input_ids.shape[0], -1)  # (batch, tokens) always: where TP's SP cuts them
        return self.drop(self.tok_emb(input_ids) + self.pos_emb(positions))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def moe_mlp(cfg: GPTConfig, layer: int) -> nn.Module:
    """Block `layer`'s MLP as a mixture of experts (common/moe.py: imported only by a model that has experts)."""
    from .moe import MoE

    moe = MoE(
        cfg.n_embd,
        cfg.n_experts,
        cfg.top_k,
        cfg.expert_hidden or max(1, 4 * cfg.n_embd // cfg.top_k),
        shared_expert=cfg.shared_expert,
        router_score=cfg.router_score,
        load_balance=cfg.load_balance,
        aux_loss_coef=cfg.aux_loss_coef,
        bias_update_rate=cfg.bias_update_rate,
        capacity_factor=cfg.capacity_factor,
    )
    moe.name = f"blocks.{layer}"
    return moe


class GPTStage(nn.Module):
    """Some consecutive blocks of the GPT, for a pipeline stage: a view that owns nothing (its parts
    are the model's modules, so parameter names, and checkpoints, are untouched). The first stage
    embeds, the last applies the final norm and head, with the model's own code (GPT.embed /
    GPT.head)."""

    def __init__(self, model: GPT, layers: range, is_first: bool, is_last: bool):
        super().__init__()
        self.tok_emb, self.pos_emb, self.drop = (
            (model.tok_emb, model.pos_emb, model.drop) if is_first else (None, None, None)
        )
        self.blocks = nn.ModuleList(model.blocks[str(i)] for i in layers)
        self.ln_f, self.lm_head = (model.ln_f, model.lm_head) if is_last else (None, None)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None):
        """`positions` (--document_mask's position_ids) travel on with the hidden states: every stage's
        attention masks by document."""
        if self.tok_emb is not None:
            x = GPT.embed(self, x, positions)  # token ids -> hidden states
        documents = documents_of(positions) if positions is not None else None
        for block in self.blocks:
            x = block(x, documents=documents)
        if self.lm_head is not None:
            return GPT.head(self, x)  # hidden states -> logits
        return x if positions is None else (x, positions)


def flops_per_token(cfg: GPTConfig, n_params: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N (forward + backward matmuls) + 12·L·d·T (attention scores)."""
    return 6 * n_params + 12 * cfg.n_layer * cfg.n_embd * seq_len


class GPTTask(CausalLMTask):
    """The contract (common/task.py) for the built-in GPT: its units are `blocks`; it exports
    its GPTConfig beside the weights (what evaluate.py reads)."""

    name = "causal_lm"
    units_path = "blocks"

    def __init__(self, cfg: GPTConfig, seq_len: int, data_task: str, preset: str = "custom"):
        super().__init__(seq_len, data_task)
        self.cfg, self.preset = cfg, preset

    def describe(self, model: nn.Module) -> str:
        n = sum(p.numel() for p in model.parameters())
        line = f"model GPT {self.preset}: {n / 1e6:.2f}M parameters, {self.cfg.n_layer} layers x {self.cfg.n_embd} wide"
        if self.cfg.n_experts:
            from .moe import active_parameters, moe_layers

            c = self.cfg
            line += (
                f"; {len(moe_layers(model))} MoE layer(s) of {c.n_experts} experts, top-{c.top_k}, "
                f"{c.load_balance} balancing: {active_parameters(model) / 1e6:.2f}M parameters active per token"
            )
        return line

    def loss_of(self, model: nn.Module, batch):
        """The LM loss sum, plus the MoE layers' auxiliary balance loss (a sum over sequences too)."""
        loss_sum, n_targets = super().loss_of(model, batch)
        if self.cfg.n_experts and self.cfg.load_balance == "aux_loss":
            from .moe import aux_loss_sum

            loss_sum = loss_sum + aux_loss_sum(model)
        return loss_sum, n_targets

    def config(self) -> dict:
        return self.cfg.to_dict()

    def flops_per_item(self, n_params: int) -> float:
        return flops_per_token(self.cfg, n_params, self.tokens_per_sample)

    def set_attention(self, model: nn.Module, attention) -> None:
        """Context parallelism: every block's attention becomes `attention` (None: causal SDPA again)."""
        for module in model.modules():
            if isinstance(module, CausalSelfAttention):
                module.attention = attention or causal_attention

    def forward_at(self, model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, documents=None):
        return model(input_ids, positions, documents)
