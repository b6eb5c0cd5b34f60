"""A 🤗 MoE family's experts under expert parallelism, read from its own config
(config.base_model_ep_plan): which modules are its experts (hf_experts_of), what EP needs of them
(check_hf_experts), and their forward between train_ep.py's dispatch and combine
(route_hf_experts). Imported only when a 🤗 model runs under EP.
"""

from __future__ import annotations

from contextlib import contextmanager
from fnmatch import fnmatch
from functools import partial

import torch
import torch.nn as nn

from .errors import UsageError
from .moe import local


def hf_experts_of(model: nn.Module) -> list:
    """The batched experts modules the family's config names for expert parallelism
    (base_model_ep_plan: 'layers.*.mlp.experts': 'ep_dispatch_experts'), each holding
    gate_up_proj (E, ...) and down_proj (E, ...), biases for gpt-oss."""
    plan = getattr(model.config, "base_model_ep_plan", None) or {}
    patterns = [name for name, style in plan.items() if style == "ep_dispatch_experts"]
    modules = model.base_model.named_modules()
    return [m for name, m in modules if any(fnmatch(name, p) for p in patterns)]


def check_hf_experts(model, task, expert_modules: list, ep: int) -> None:
    """What EP needs of a 🤗 model, one line each, before training: experts to cut (a dense
    family has none), a count ep divides, and routing that a data-parallel split does not change."""
    c = task.hf_config
    if not expert_modules and any("experts" in name for name, _ in model.named_modules()):
        raise UsageError(  # Llama 4: experts that compute every token, weighted by the router's mask
            f"train_ep.py cuts the experts of MoE layers, and {c.model_type}'s are not named for expert "
            "parallelism (its config has no ep_dispatch_experts in base_model_ep_plan), so nothing says "
            "how its MoE layers call them: train it with train_fsdp.py"
        )
    if not expert_modules:
        raise UsageError(
            f"train_ep.py cuts the experts of MoE layers, and {c.model_type} has none (its config "
            "names no ep_dispatch_experts in base_model_ep_plan): train this dense model with "
            "train_fsdp.py"
        )
    n_experts = {p.shape[0] for experts in expert_modules for p in experts.parameters()}
    if len(n_experts) != 1 or next(iter(n_experts)) % ep:
        raise UsageError(
            f"--ep_size {ep}: {c.model_type}'s MoE layers hold {sorted(n_experts)} experts, which "
            f"{ep} ranks cannot hold equal shares of; use an --ep_size that divides the expert "
            "count"
        )
    jitter = {n: getattr(c, n, 0) for n in ("router_jitter_noise", "input_jitter_noise")}  # PhiMoE: both
    for name, noise in jitter.items():
        if noise:
            raise UsageError(
                f"{c.model_type}'s {name} {noise} scales every token by random noise, which "
                f"differs with the layout; set {name} 0 in the config"
            )


def route_hf_experts(experts: nn.Module, ep_mesh, dispatch, combine) -> None:
    """A family's experts module, already cut over the ep ranks (Shard(0)), takes
    hf_experts_forward in place of its forward: the family's MoE block calls it with every token
    and its top-k, not with tokens sorted by expert, so dispatch and combine (train_ep.py's) run
    inside it."""
    family_forward = experts.forward  # the family's own expert math (activation, biases, kernels)
    experts.num_experts //= ep_mesh.size()  # its forward loops over the experts this rank holds
    routes = (ep_mesh, dispatch, combine)
    experts.forward = partial(hf_experts_forward, experts, family_forward, routes)


def hf_experts_forward(experts, family_forward, routes, hidden_states, top_k_index, top_k_weights):
    """A 🤗 family's experts under EP, called as its MoE block calls them: every token of this
    rank (N, d), its top-k experts (N, k, global ids) and their weights (N, k), which its router
    chose (unchanged).

        1-2. each (token, expert) pair to the rank holding that expert: dispatch, as the GPT's
        3.   the family's own forward on this rank's slice of the batched weights: the pairs
             arrive as top-1 choices of local experts 0 .. E/ep - 1 with weight 1 (its biases
             and activation stay its own)
        4.   combine: the outputs back home, weighted there by top_k_weights and summed per
             token, so the router's gradient is computed where its tokens are, as on one process"""
    ep_mesh, dispatch, combine = routes
    top_k = top_k_index.shape[-1]
    flat_experts = top_k_index.reshape(-1)
    order = flat_experts.argsort(stable=True)  # the pairs sorted by expert (token order inside)
    pairs_per_expert = torch.bincount(flat_experts, minlength=experts.num_experts * ep_mesh.size())
    pairs = (hidden_states[order // top_k], pairs_per_expert)
    received, received_per_expert = dispatch(experts, pairs, ep_mesh)
    n_received = int(received_per_expert.sum())
    local_experts = torch.arange(len(received_per_expert), device=received.device)
    local_ids = local_experts.repeat_interleave(received_per_expert)  # each pair's local expert
    if len(received) == 0:  # no pair for my experts: one zero row keeps the backward running
        received, local_ids = received.sum(0, keepdim=True), local_ids.new_zeros(1)  # (FSDP's too)
    unit_weights = torch.ones(len(received), 1, dtype=received.dtype, device=received.device)
    with local_shards(experts):  # the family's forward reads plain tensors, this rank's experts
        expert_out = family_forward(received, local_ids[:, None], unit_weights)[:n_received]
    expert_out = combine(experts, expert_out, ep_mesh)  # home, in the order the pairs were sent
    weighted = expert_out * top_k_weights.reshape(-1)[order, None].to(expert_out.dtype)
    tokens = order // top_k
    return torch.zeros_like(hidden_states).index_add_(0, tokens, weighted.to(hidden_states.dtype))


@contextmanager
def local_shards(experts):
    """The experts' parameters as this rank's local tensors (Shard(0) of the DTensors) while the
    family's forward runs: it indexes them by expert; gradients flow back into the DTensors."""
    sharded = dict(experts._parameters)
    experts._parameters.update({name: local(param) for name, param in sharded.items()})
    try:
        yield
    finally:
        experts._parameters.update(sharded)
