"""What train_ep.py reports of expert parallelism: its first line (the experts each rank holds), the
routing in each train record, and the experts' bytes in the summary."""

from __future__ import annotations

from .moe import dropped_share, expert_load
from .sharded_costs import local_bytes


def ep_start_line(n_experts: int, ep_size: int, dp_size: int) -> str:
    """What the run's first lines say of EP: the experts each rank holds, and how FSDP cuts them
    again."""
    if dp_size == 1:
        return "EP over 1 rank: every expert is local, nothing is sent"
    ep_line = f"EP over {ep_size} ranks: {n_experts // ep_size} of {n_experts} experts per rank"
    again = f", each cut again over {dp_size // ep_size} groups (FSDP)" if dp_size > ep_size else ""
    return ep_line + again


def routing_record(model, ep_size: int) -> dict:
    """What a train record adds: ep, and per MoE layer the last step's largest token count over
    the mean (1.0: perfectly balanced; counted over the whole global batch), and where a layer caps
    its experts (--capacity_factor) the share of token copies dropped."""
    capped = any(getattr(m, "capacity_factor", None) for m in model.modules())
    dropped = {"dropped_share": dropped_share(model)} if capped else {}
    return {"ep": ep_size, "expert_load": expert_load(model), **dropped}


def ep_summary(expert_modules: list, ep_size: int) -> dict:
    """What the summary adds: ep, and the bytes of the expert weights this rank holds."""
    expert_bytes = local_bytes(p for experts in expert_modules for p in experts.parameters())
    return {"ep": ep_size, "expert_param_bytes_per_rank": expert_bytes}
