"""A mixture-of-experts layer for the built-in GPT: token-choice top-k routing, batched experts,
and load balancing. Like the rest of the model it knows nothing about parallelism.

    x (N tokens, d) ──router──> scores (N, E) ──top-k of scores + bias──> chosen (N, k), gates (N, k)
          │
          └─ copy each token k times, sort the copies by expert ─> tokens (N·k, d), tokens_per_expert (E,)
                                                                        │
              experts(tokens, tokens_per_expert)   <── THE SEAM: expert parallelism (train_ep.py) wraps
                 expert e: down_proj[e](GELU(up_proj[e](its tokens)))    this call with an all-to-all
                                                                        │    that sends each token to the
          out = Σ_k gate · expert output (unsorted back to the tokens)  <┘    rank holding its expert and back
          (+ a shared expert every token goes through, --shared_expert)

Balancing (--load_balance):
    aux_free  DeepSeek-V3's aux-loss-free bias: a per-expert bias is added to the scores only to CHOOSE
              the experts (the gates use the scores without it). Before each optimizer step the token
              counts of the whole step (all micro-batches, all ranks: one all-reduce) update it:
              bias_e += rate · sign(mean count - count_e). An overloaded expert gets chosen less.
    aux_loss  Switch/GShard's auxiliary loss E · Σ_e f_e · P_e (f_e: share of the choices that went to
              e, P_e: mean router probability of e), times --aux_loss_coef, computed per SEQUENCE
              (DeepSeek-V3's sequence-wise form) and summed over the tokens like the LM loss.
    none      nothing steers the router.

Both are independent of how the global batch is split over ranks: the bias update sees the summed
counts of the whole step, and the auxiliary loss is a sum over sequences (each sequence lives on
one rank), divided by the step's target count like the LM loss. So 1 process and N processes
train the same model.
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

BALANCE_KINDS = ("aux_free", "aux_loss", "none")
ROUTER_SCORES = ("softmax", "sigmoid")


def local(weight: torch.Tensor) -> torch.Tensor:
    """The part of a weight this process holds: the whole tensor, or a DTensor's local shard
    (under expert parallelism each rank holds some of the experts)."""
    return weight.to_local() if hasattr(weight, "to_local") else weight


class GroupedExperts(nn.Module):
    """E expert MLPs as batched parameters of shape (E, ...): up_proj (E, d, h), down_proj (E, h, d).

    forward(tokens, tokens_per_expert): `tokens` sorted by expert, `tokens_per_expert[e]` rows each,
    for the experts this process holds (all of them on one process). A grouped loop, one matmul pair
    per expert (`torch._grouped_mm` would do it in one call, but on torch 2.13 it does not run on CPUs)."""

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.up_proj = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.down_proj = nn.Parameter(torch.empty(n_experts, hidden, dim))

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        up, down = local(self.up_proj), local(self.down_proj)
        pieces = tokens.split(tokens_per_expert.tolist())
        out = [F.gelu(piece @ up[e]) @ down[e] for e, piece in enumerate(pieces)]
        return torch.cat(out) if out else tokens


class MoE(nn.Module):
    """The MLP of a block, as a mixture of experts (see the module's docstring)."""

    def __init__(
        self,
        dim: int,
        n_experts: int,
        top_k: int,
        hidden: int,
        shared_expert: bool = False,
        router_score: str = "softmax",
        load_balance: str = "aux_free",
        aux_loss_coef: float = 0.01,
        bias_update_rate: float = 1e-3,
        capacity_factor: float | None = None,
    ):
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.router_score, self.load_balance = router_score, load_balance
        self.aux_loss_coef, self.bias_update_rate = aux_loss_coef, bias_update_rate
        self.capacity_factor = capacity_factor
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = GroupedExperts(n_experts, dim, hidden)
        self.shared = SharedExpert(dim, hidden) if shared_expert else None
        # steers the choice only; saved in checkpoints and in the exported model (a buffer, not trained)
        self.register_buffer("expert_bias", torch.zeros(n_experts))
        # token copies per expert over this rank's micro-batches of the step: a plain attribute, not a
        # buffer (DDP would overwrite it with rank 0's at every forward); the bias update resets it
        self.tokens_per_expert: torch.Tensor | None = None
        self.kept_per_expert: torch.Tensor | None = None  # the same after --capacity_factor dropped some
        self.expert_load: torch.Tensor | None = None  # the last step's counts, summed over every process
        self.dropped_share: float | None = None  # the last step's share of token copies dropped (capacity)
        self.aux_loss_sum: torch.Tensor | None = None  # set by each forward under aux_loss
        self.dump_routing: str | None = None  # debug: a folder for the first training forward's choices
        self.name = "moe"

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token-choice top-k: (scores (N, E), chosen experts (N, k), gates (N, k))."""
        logits = self.router(x).float()
        scores = logits.softmax(-1) if self.router_score == "softmax" else logits.sigmoid()
        with torch.no_grad():  # the bias only chooses; it never enters the gates (no gradient either)
            biased = scores + self.expert_bias if self.load_balance == "aux_free" else scores
            chosen = biased.topk(self.top_k, dim=-1).indices
        gates = scores.gather(-1, chosen)
        if self.top_k > 1 or self.router_score == "sigmoid":  # renormalise over the chosen experts
            gates = gates / gates.sum(-1, keepdim=True)
        return scores, chosen, gates

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        flat = x.reshape(B * T, d)
        scores, chosen, gates = self.route(flat)
        step = self.training and torch.is_grad_enabled()  # a step's forward, not a check's before step 1
        if step and self.dump_routing:
            self._dump(chosen.view(B, T, self.top_k))
        counts = torch.bincount(chosen.flatten(), minlength=self.n_experts)
        if step:
            self.tokens_per_expert = counts if self.tokens_per_expert is None else self.tokens_per_expert + counts
        self.aux_loss_sum = self._aux_loss(scores.view(B, T, -1), chosen.view(B, T, -1)) if self.training else None

        # copies of each token, one per chosen expert, sorted by expert (stable: token order inside)
        order = chosen.flatten().argsort(stable=True)
        keep = self._within_capacity(counts, B * T) if self.capacity_factor else None
        if keep is not None:
            order, counts = order[keep], counts.clamp(max=self._capacity(B * T))
            if step:
                self.kept_per_expert = counts if self.kept_per_expert is None else self.kept_per_expert + counts
        expert_out = self.experts(flat[order // self.top_k], counts)  # the seam (train_ep.py)

        # combine: each copy's output, weighted by its gate, added back onto its token
        weighted = expert_out * gates.flatten()[order, None].to(expert_out.dtype)
        out = torch.zeros_like(flat).index_add_(0, order // self.top_k, weighted.to(flat.dtype))
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.view(B, T, d)

    def _aux_loss(self, scores: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor | None:
        """Switch/GShard balance loss per sequence, E · Σ_e f_e · P_e, summed over the tokens (T per
        sequence) so that it adds up over samples like the LM loss sum."""
        if self.load_balance != "aux_loss":
            return None
        B, T, E = scores.shape
        probs = scores / scores.sum(-1, keepdim=True)  # sigmoid scores do not sum to 1
        with torch.no_grad():
            picked = torch.zeros(B, E, device=scores.device).scatter_add_(
                1, chosen.reshape(B, -1), torch.ones(B, T * self.top_k, device=scores.device)
            )
            share = picked / (T * self.top_k)  # f_e per sequence
        per_sequence = E * (share * probs.mean(1)).sum(-1)  # (B,)
        return self.aux_loss_coef * T * per_sequence.sum()

    def _capacity(self, n_tokens: int) -> int:
        return math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts)

    def _within_capacity(self, counts: torch.Tensor, n_tokens: int) -> torch.Tensor:
        """--capacity_factor: each expert takes at most C copies of this micro-batch's tokens (the
        first ones in token order); the rest are dropped: they pass through the residual only."""
        starts = counts.cumsum(0) - counts
        expert_of_copy = torch.repeat_interleave(torch.arange(self.n_experts, device=counts.device), counts)
        position = torch.arange(len(expert_of_copy), device=counts.device) - starts[expert_of_copy]
        return position < self._capacity(n_tokens)

    def _dump(self, chosen: torch.Tensor) -> None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        path = os.path.join(self.dump_routing, f"rank{rank}_{self.name}.pt")
        if not os.path.exists(path):  # the first training forward only
            os.makedirs(self.dump_routing, exist_ok=True)
            torch.save(chosen.cpu(), path)


class SharedExpert(nn.Module):
    """DeepSeek-V3's shared expert: one more MLP that every token goes through."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def active_parameters(model: nn.Module) -> int:
    """Parameters a token goes through: all of them, less the experts it did not choose."""
    total = sum(p.numel() for p in model.parameters())
    return total - sum((m.n_experts - m.top_k) * 2 * math.prod(m.experts.up_proj.shape[1:]) for m in moe_layers(model))


def aux_loss_sum(model: nn.Module):
    """The auxiliary balance losses of the last forward, summed over the MoE layers (0: none)."""
    return sum(m.aux_loss_sum for m in moe_layers(model) if m.aux_loss_sum is not None)


@torch.no_grad()
def update_expert_bias(model: nn.Module) -> None:
    """Before each optimizer step (train_ep.py calls it after the step's backward; the MODEL sections of
    train_ddp.py and train_fsdp.py hook it to the optimizer): sum the step's token counts per expert
    over every process (one all-reduce for all layers; `expert_load` keeps them for the logs), then,
    under aux_free, move each bias towards balance: bias_e += rate · sign(mean - count_e). Summing over all processes
    counts every data-parallel replica equally often, so the signs are those of the global batch
    whatever the layout."""
    layers = [m for m in moe_layers(model) if m.tokens_per_expert is not None]
    if not layers:
        return
    routed = [m.tokens_per_expert for m in layers]
    kept = [m.tokens_per_expert if m.kept_per_expert is None else m.kept_per_expert for m in layers]
    counts = torch.stack([torch.stack(routed), torch.stack(kept)], dim=1).float()  # (layers, routed | kept, E)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(counts)
    for layer, (c, k) in zip(layers, counts, strict=True):
        layer.expert_load, layer.tokens_per_expert, layer.kept_per_expert = c, None, None
        layer.dropped_share = float(1 - k.sum() / c.sum())
        if layer.load_balance == "aux_free":
            layer.expert_bias += layer.bias_update_rate * torch.sign(c.mean() - c)


def dropped_share(model: nn.Module) -> list[float]:
    """Per MoE layer, the share of the last step's token copies that --capacity_factor dropped."""
    return [round(m.dropped_share, 4) for m in moe_layers(model) if m.dropped_share is not None]


def expert_load(model: nn.Module) -> list[float]:
    """Per MoE layer, the last step's largest token count over the mean (1: perfectly balanced)."""
    loads = [m.expert_load for m in moe_layers(model) if m.expert_load is not None]
    return [round(float(c.max() / c.mean()), 4) for c in loads]
