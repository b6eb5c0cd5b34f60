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
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .causal_lm import CausalLMTask, document_causal_mask, documents_of
from .errors import UsageError
from .presets import MODEL_PRESETS

VOCAB_SIZE = 256  # byte-level: every data set is UTF-8 bytes, so no tokenizer download is ever needed


@dataclass
class GPTConfig:
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    block_size: int = 64
    vocab_size: int = VOCAB_SIZE
    dropout: float = 0.0
    # mixture of experts (common/moe.py, docs/ep.md); n_experts 0: every block has a dense MLP
    n_experts: int = 0
    top_k: int = 2
    moe_every: int = 1  # every n-th block's MLP is a mixture of experts
    expert_hidden: int = 0  # 0: 4 x n_embd / top_k (the active MLP width of the dense model)
    shared_expert: bool = False
    router_score: str = "softmax"
    load_balance: str = "aux_free"
    aux_loss_coef: float = 0.01
    bias_update_rate: float = 1e-3
    capacity_factor: float | None = None  # None: no token is dropped

    def to_dict(self) -> dict:
        d = asdict(self)
        if not self.n_experts:  # a dense model's config.json stays as it was
            d = {k: v for k, v in d.items() if k in DENSE_FIELDS}
        return d

    def is_moe_block(self, layer: int) -> bool:
        return self.n_experts > 0 and (layer + 1) % self.moe_every == 0

    @classmethod
    def from_dict(cls, d: dict) -> "GPTConfig":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "GPTConfig":
        n_layer, n_head, n_embd, block_size = MODEL_PRESETS[name]
        cfg = cls(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size)
        for key, value in overrides.items():
            if value is not None:
                setattr(cfg, key, value)
        return cfg


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


DENSE_FIELDS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "dropout")


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


def gpt_config_from_args(args) -> GPTConfig:
    cfg = GPTConfig.from_preset(
        args.model_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        block_size=args.block_size,
        dropout=getattr(args, "dropout", None),  # plan_layout.py has no --dropout
        **{k: getattr(args, k, None) for k in MOE_FLAGS},
    )
    check_moe_config(cfg)
    if cfg.n_embd % cfg.n_head:
        raise UsageError(
            f"--n_embd {cfg.n_embd} is not divisible by --n_head {cfg.n_head}: "
            "choose a head count that divides the width"
        )
    return cfg


MOE_FLAGS = (
    "n_experts",
    "top_k",
    "moe_every",
    "expert_hidden",
    "router_score",
    "load_balance",
    "aux_loss_coef",
    "bias_update_rate",
    "capacity_factor",
    "shared_expert",
)


def check_moe_config(cfg: GPTConfig) -> None:
    """The MoE flags, one line each (before any process group exists)."""
    if cfg.n_experts < 0:
        raise UsageError(f"--n_experts must not be negative (got {cfg.n_experts}; 0: a dense model)")
    if not cfg.n_experts:
        return
    from .moe import BALANCE_KINDS, ROUTER_SCORES

    if not 1 <= cfg.top_k <= cfg.n_experts:
        raise UsageError(
            f"--top_k {cfg.top_k} with --n_experts {cfg.n_experts}: each token chooses top_k of the experts, so "
            f"1 <= top_k <= n_experts; lower --top_k or raise --n_experts"
        )
    if cfg.moe_every < 1 or cfg.moe_every > cfg.n_layer:
        raise UsageError(
            f"--moe_every {cfg.moe_every}: every n-th block becomes a mixture of experts, so 1 <= n <= --n_layer "
            f"({cfg.n_layer})"
        )
    if cfg.expert_hidden < 0:
        raise UsageError(f"--expert_hidden must not be negative (got {cfg.expert_hidden}; 0: 4 x n_embd / top_k)")
    if cfg.router_score not in ROUTER_SCORES:
        raise UsageError(f"--router_score {cfg.router_score!r}: choose {' or '.join(ROUTER_SCORES)}")
    if cfg.load_balance not in BALANCE_KINDS:
        raise UsageError(f"--load_balance {cfg.load_balance!r}: choose {', '.join(BALANCE_KINDS)}")
    if cfg.capacity_factor is not None and cfg.capacity_factor <= 0:
        raise UsageError(f"--capacity_factor must be positive (got {cfg.capacity_factor}; leave it out: no dropping)")
    if cfg.aux_loss_coef < 0 or cfg.bias_update_rate < 0:
        raise UsageError("--aux_loss_coef and --bias_update_rate must not be negative")


def context_length(args) -> int:
    """The longest sequence the model takes (what the data is cut to), before the model exists."""
    if getattr(args, "model_name_or_path", None) or getattr(args, "model_config", None):
        from .hf import hf_context_length

        return hf_context_length(args)
    return gpt_config_from_args(args).block_size


def tokenizer_for(args):
    """The tokenizer of a pretrained 🤗 model folder that has one; None: the byte vocabulary (the GPT,
    and models built from a config)."""
    if getattr(args, "model_name_or_path", None):
        from .hf import load_tokenizer

        return load_tokenizer(args)
    return None


def language_model(args, data, on_meta: bool = False) -> tuple[nn.Module, CausalLMTask]:
    """The built-in GPT (--model_size and overrides), or a 🤗 transformers causal LM
    (--model_name_or_path, --model_config), and its Task. Seed first: every rank builds the same
    full model before any strategy cuts it. `on_meta`: a 🤗 model comes on the meta device, its weights
    made after the strategy has cut it (common/hf.py materialize_hf); the GPT is built whole."""
    if getattr(args, "model_name_or_path", None) or getattr(args, "model_config", None):
        from .hf import load_hf_model

        return load_hf_model(args, data.seq_len, data.task, on_meta=on_meta)
    cfg = gpt_config_from_args(args)
    model = GPT(cfg)
    if cfg.n_experts:
        from .moe import moe_layers

        for moe in moe_layers(model):
            moe.dump_routing = getattr(args, "dump_routing", None)  # debug: the first step's expert choices
    return model, GPTTask(cfg, data.seq_len, data.task, args.model_size)


def check_gpt_split(cfg: GPTConfig, tp: int = 1, n_stages: int = 1, stages_per_rank: int = 1) -> None:
    """What the GPT's cuts must divide: TP splits the heads, the MLP width and the vocabulary; a
    pipeline needs a layer per stage. One line each (UsageError)."""
    if tp > 1:
        for what, size, fix in (
            ("--n_head", cfg.n_head, "heads"),
            ("the MLP width (4 x n_embd)", 4 * cfg.n_embd, "MLP columns"),
            ("the vocabulary", cfg.vocab_size, "vocabulary rows"),
        ):
            if size % tp:
                raise UsageError(
                    f"--tp_size {tp} does not divide {what} ({size})"
                    f": every TP rank needs the same number of {fix}; use a --tp_size that divides {size}"
                )
    if n_stages > cfg.n_layer:
        raise UsageError(
            f"--pp_size {n_stages // stages_per_rank} x --stages_per_rank {stages_per_rank} = {n_stages} stages"
            f", but the model has {cfg.n_layer} layers"
            ": every stage needs at least one layer (lower --pp_size or raise --n_layer)"
        )
