"""What train_localsgd.py's fusions cost and how far apart its replicas are: the start line
(fusion_line), the train records' spread (replica_spread, replicas) and the summary's figures
(localsgd_summary), from the fragments, the flags and the fusions' record; byte counts by the ring
formula."""

from __future__ import annotations

import torch

from .batchnorm import running_stats
from .costs import replicated_summary, ring_allreduce_bytes


def fragment_mib(fragments: list, dp_size: int, outer_dtype: str) -> list[float]:
    """MiB each rank sends to fuse each fragment: a ring all-reduce of its flat buffer
    (--outer_dtype)."""
    element_size = 2 if outer_dtype == "bf16" else 4
    return [
        ring_allreduce_bytes(sum(p.numel() for p in fragment) * element_size, dp_size) / 2**20 for fragment in fragments
    ]


def ddp_mib(n_params: int, dp_size: int) -> float:
    """What DDP would send per step and rank: the fp32 gradients, all-reduced."""
    return ring_allreduce_bytes(4 * n_params, dp_size) / 2**20


def fusion_line(args, fragments: list, dp_size: int, n_params: int) -> str:
    """The start line: how the replicas are fused, and the bytes per fusion and per step against
    DDP's."""
    method = "DiLoCo" if args.outer_optimizer == "nesterov" else "Local SGD"
    where = f" in {args.fragments} fragments, each" if args.fragments > 1 else ""
    if args.overlap_steps:
        method += f" overlapping each fusion with {args.overlap_steps} steps (mix {args.overlap_mix})"
    fusion_mib = fragment_mib(fragments, dp_size, args.outer_dtype)
    return (
        f"{method}: fusing every {args.sync_every} steps{where}; {max(fusion_mib):.2f} MiB per "
        f"fusion and rank = {sum(fusion_mib) / args.sync_every:.3f} MiB per step (DDP: "
        f"{ddp_mib(n_params, dp_size):.2f} MiB per step)"
    )


def parameter_fingerprint(params) -> torch.Tensor:
    """One number that differs when any parameter differs (a position-weighted sum, in float64)."""
    return sum((i + 1) * p.detach().double().sum() for i, p in enumerate(params))


def replica_spread(accelerator, model, fragments: list) -> list[float]:
    """How far apart the replicas are, per fragment (the last with BatchNorm's running statistics):
    the spread of their fingerprints over the ranks, 0 right after the fragment's fusion. Collective
    (one all-gather)."""
    compared = [*fragments[:-1], fragments[-1] + running_stats(model)]
    fingerprints = torch.stack([parameter_fingerprint(fr) for fr in compared]).to(accelerator.device)
    gathered = accelerator.gather(fingerprints.reshape(1, -1))  # Accelerate: all-gather
    return (gathered.max(0).values - gathered.min(0).values).tolist()


def replicas(accelerator, model, fragments: list, fused: list[int]) -> dict:
    """What a train record adds: whether the step ended with a fusion (which fragments), and the
    spread of the replicas (parameters and BatchNorm statistics). Collective."""
    spread = replica_spread(accelerator, model, fragments)
    record = {"fused": bool(fused), "param_spread": max(spread)}
    if len(fragments) > 1:
        record |= {"fused_fragments": fused, "fragment_spread": spread}
    return record


def localsgd_summary(accelerator, args, fragments: list, record, steps: int, n_params: int) -> dict:
    """Collective: what the summary records: the replicated run's figures (no gradient all-reduce:
    the fusions instead), the fusion settings, the fusions and the bytes they moved (measured calls
    and buffers; per rank by the ring formula), and what DDP would have sent."""
    dp_size = accelerator.num_processes
    fusion_mib = fragment_mib(fragments, dp_size, args.outer_dtype)
    fused_mib = sum(fusion_mib[f] * n for f, n in enumerate(record.fusions))
    counted = record.counter.report().get("all_reduce", {"calls": 0, "mib": 0.0})
    per_step_ddp = ddp_mib(n_params, dp_size)
    return replicated_summary(accelerator, n_params, 0.0) | {
        "sync_every": args.sync_every,
        "outer_optimizer": args.outer_optimizer,
        "fragments": args.fragments,
        "outer_dtype": args.outer_dtype,
        "overlap_steps": args.overlap_steps,
        "overlap_mix": args.overlap_mix,
        "fusion_wait_s": round(record.wait_s, 3),  # DiLoCo: the steps' time spent waiting for a fusion
        "fusions": sum(record.fusions),
        "fusions_per_fragment": record.fusions,
        "fusion_allreduce_calls": counted["calls"],
        "fusion_allreduce_buffer_mib": round(counted["mib"], 4),
        "fusion_mib_per_rank": round(fused_mib, 4),
        "peak_fusion_mib_per_rank": round(max(fusion_mib), 4),
        "allreduce_mib_per_step_per_rank": round(fused_mib / max(1, steps), 5),
        "ddp_allreduce_mib_per_step_per_rank": round(per_step_ddp, 4) if dp_size > 1 else 0.0,
    }
