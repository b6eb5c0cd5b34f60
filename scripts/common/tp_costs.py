"""What train_tp.py's plan splits, and Megatron's count of its all-reduces: the start lines and the
summary's figures (tp_start_lines)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.nn as nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from .tp_checks import key_matches

if TYPE_CHECKING:  # annotations only: the layout module is not needed to run this one
    from .layout import Layout

# What train_tp.py's plan for the built-in GPT cuts, by the module's own name (the planner's copy, which
# tests/test_plan_layout.py holds to the lesson's tensor_parallel_plan): column-wise cuts the outputs,
# row-wise the inputs (an embedding's vocabulary rows)
GPT_TP_CUTS = {
    "tok_emb": "rowwise",
    "q_proj": "colwise",
    "k_proj": "colwise",
    "v_proj": "colwise",
    "o_proj": "rowwise",
    "up_proj": "colwise",
    "down_proj": "rowwise",
    "lm_head": "colwise",
}


def tp_start_lines(
    model: nn.Module, plan: dict, layout: Layout, args, seq_len: int, on_meta: bool = False
) -> tuple[list[str], dict]:
    """What the plan splits, and Megatron's count of the step's all-reduces (2 per row-wise Linear: g in
    forward, f in backward, each of b*s*d activations in fp32), for the start lines and the summary."""
    if layout.tp == 1:
        return ["tensor parallel: 1 rank per group: nothing to split, so the TP plan is not applied"], {}
    rowwise = [key for key, style in plan.items() if isinstance(style, RowwiseParallel)]
    row = [
        m
        for name, m in model.named_modules()
        if isinstance(getattr(m, "base_layer", m), nn.Linear) and any(key_matches(k, name) for k in rowwise)  # LoRA
    ]
    n_col = sum(isinstance(s, ColwiseParallel) or _copies_kv(s) for s in plan.values())
    n_row = sum(isinstance(s, RowwiseParallel) for s in plan.values())
    width = max((m.out_features for m in row), default=0)
    mib = 4 * args.batch_size * seq_len * width / 2**20  # one all-reduce of b*s*d, fp32
    on_off = {True: "on", False: "off"}
    lines = [
        f"tensor parallel: {layout.tp} ranks per group; the plan splits {n_col} layers column-wise (outputs: heads, "
        f"MLP columns, vocabulary) and {n_row} row-wise (inputs), 1/{layout.tp} of each per rank; sequence parallel "
        f"{on_off[args.sequence_parallel]}, loss parallel {on_off[args.loss_parallel]}",
        f"Megatron's count per step: 2 all-reduces per row-wise layer of b*s*d = {mib:.3f} MiB "
        f"({2 * len(row)} for {len(row)} row-wise Linear layers); measured below",
    ]
    figures = {
        "megatron_allreduce_mib_each": round(mib, 4),
        "megatron_allreduces_per_step": 2 * len(row) * args.gradient_accumulation_steps,
    }
    kv = [(name, s) for name, s in plan.items() if _copies_kv(s)]
    if kv:  # Megatron's copies of the KV heads: what each rank holds beyond an even 1/tp of those weights
        extra = round(
            sum(
                (p.to_local().numel() - p.numel() / layout.tp) * p.element_size()
                for name, _ in kv
                for p in model.get_submodule(name).parameters()
            )
        )
        # the weight, its gradient (and AdamW's two moments; Muon's one, as these are hidden matrices)
        states = {"adamw": 4, "muon": 3}.get(args.optimizer, 2)
        n_kv = kv[0][1].n_kv_heads
        lines.append(
            f"KV heads: {n_kv} for {layout.tp} ranks, so each is replicated on {layout.tp // n_kv} ranks (Megatron): "
            f"every rank keeps the one its query heads use, in {len(kv)} k/v projections, {extra:,} bytes of weights "
            f"per rank over an even 1/{layout.tp} split of them ({states * extra:,} with their gradients and "
            f"{args.optimizer} state); the copies' gradients are summed"
        )
        figures["kv_copies_extra_weight_bytes_per_rank"] = extra
    if on_meta:  # a 🤗 model built on meta
        lines.append("each rank made only its shards of the weights (built on meta)")
    return lines, figures


def _copies_kv(style) -> bool:
    """common.hf_tp's KVHeadsReplicated, known by its field: a GPT run never imports the 🤗 code."""
    return hasattr(style, "n_kv_heads")
