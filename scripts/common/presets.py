"""The built-in GPT's configuration without the model: the size presets (--model_size), the config built
from the flags and its checks (heads, the MoE flags, what TP and PP must divide). The command line
(common/builtin_flags.py) checks the flags with it, and a saved config.json is read back with it,
without importing the model (common/gpt.py)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .errors import UsageError

# name: (n_layer, n_head, n_embd, block_size)
MODEL_PRESETS = {
    "tiny": (2, 4, 64, 64),  # tests: a 20-step run takes seconds on one core
    "small": (4, 4, 128, 128),  # the CPU demo (default main job)
    "gpt2": (12, 12, 768, 1024),  # GPT-2 shapes (85M here: the byte vocabulary has 256 rows, not 50257)
    "gpt2-medium": (24, 16, 1024, 1024),  # GPT-2 medium shapes (~303M here)
    "1b": (24, 16, 2048, 2048),  # ~1.2B, for GPUs
}

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


DENSE_FIELDS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "dropout")


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
    from .moe import BALANCE_KINDS, ROUTER_SCORES  # only a mixture of experts needs them

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
