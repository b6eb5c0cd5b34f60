"""What a pipeline costs: the bubble in theory (bubble_theory), the start lines (the stages, the
schedule, the bubble), and what the schedule measures on this rank (ScheduleMeter, held by the
lesson's PipelineStep beside torch's PipelineStages): the time they compute, the micro-batches whose
activations they hold at once, the bytes autograd saves for one of them; the summary's figures.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from .pipeline import stage_layers

if TYPE_CHECKING:
    from .layout import Layout


def bubble_theory(pp: int, n_microbatches: int, stages_per_rank: int = 1) -> float:
    """Idle fraction of GPipe/1F1B: (p-1)/(m+p-1); interleaving v stages per rank divides the
    bubble's length by v: (p-1)/(v*m+p-1)."""
    return (pp - 1) / (stages_per_rank * n_microbatches + pp - 1)


def pipeline_start_lines(layout: Layout, n_units: int, args) -> list[str]:
    """The stages and their units, the schedule and its micro-batches, the bubble in theory."""
    n_stages = layout.pp * args.stages_per_rank
    ranges = stage_layers(n_units, n_stages, args.split_points)
    stage_list = ", ".join(f"{s}: units {r.start}-{r.stop - 1}" for s, r in enumerate(ranges))
    bubble = bubble_theory(layout.pp, args.n_microbatches, args.stages_per_rank)
    pipeline_line = (
        f"pipeline: {n_stages} stages ({stage_list}), schedule {args.schedule}, "
        f"{args.n_microbatches} micro-batches of {args.batch_size // args.n_microbatches}"
    )
    bubble_line = f"bubble in theory: (p-1)/(v*m+p-1) = {bubble:.3f}; measured in the summary"
    return [pipeline_line, bubble_line]


class ScheduleMeter:
    """What the schedule costs this rank, measured on the PipelineStages it runs: the time they compute
    (forward, backward, weight gradients), the most micro-batches whose activations they hold at once,
    the bytes autograd saves for one micro-batch's backward; over the run, that time against the steps'
    time (the measured bubble). It times each stage's three compute calls on the stage object itself
    (forward_one_chunk, backward_one_chunk, backward_weight_one_chunk): the stages stay torch's own,
    and a step without a meter trains the same."""

    def __init__(self, stages: list, accelerator, layout: Layout):
        self.stages, self.accelerator, self.layout = stages, accelerator, layout
        self.busy_s = self.step_s = self.step_busy_s = 0.0
        self.max_in_flight, self.steps = 0, 0
        self.activation_bytes = [None] * len(stages)  # each stage's, at its first forward with gradients
        for k, stage in enumerate(stages):
            self.time_compute(stage, k)

    def time_compute(self, stage, k: int) -> None:
        """Wrap stage `k`'s compute calls, on the instance, with this meter's timer."""

        def clocked(call):
            def run(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return call(*args, **kwargs)
                finally:
                    self.step_busy_s += time.perf_counter() - start

            return run

        forward = clocked(stage.forward_one_chunk)

        def timed_forward(*args, **kwargs):
            if self.activation_bytes[k] is not None or not torch.is_grad_enabled():
                output = forward(*args, **kwargs)
            else:  # the first forward with gradients: the bytes autograd keeps for its backward
                storages: dict[int, int] = {}
                with torch.autograd.graph.saved_tensors_hooks(lambda t: count_storage(t, storages), lambda t: t):
                    output = forward(*args, **kwargs)
                self.activation_bytes[k] = sum(storages.values())
            if torch.is_grad_enabled():  # the micro-batches whose activations wait for their backward
                self.max_in_flight = max(self.max_in_flight, len(stage.fwd_cache))
            return output

        stage.forward_one_chunk = timed_forward
        stage.backward_one_chunk = clocked(stage.backward_one_chunk)
        stage.backward_weight_one_chunk = clocked(stage.backward_weight_one_chunk)

    @contextmanager
    def timed(self):
        """Around one step's schedule.step."""
        self.step_busy_s = 0.0
        start = time.perf_counter()
        yield
        if self.steps > 0:  # the first step also sets up the stages: not in the bubble
            self.step_s += time.perf_counter() - start
            self.busy_s += self.step_busy_s
        self.steps += 1

    def summary(self, args) -> dict:
        """Per stage (pipeline rank): measured bubble, micro-batches in flight, activation memory;
        beside the theory. Collective (a gather)."""
        layout = self.layout
        busy = self.busy_s / self.step_s if self.step_s else -1.0
        act = max((n or 0) for n in self.activation_bytes)
        row = torch.tensor(
            [layout.pp_rank, busy, self.max_in_flight, act, act * self.max_in_flight],
            dtype=torch.float64,
            device=self.accelerator.device,
        )
        rows = self.accelerator.gather(row[None]).cpu()  # Accelerate: all-gather
        per_stage = {int(r[0]): r for r in rows}  # one rank per pipeline position
        ranks = sorted(per_stage)
        return {
            "pipeline_schedule": args.schedule,
            "n_microbatches": args.n_microbatches,
            "stages_per_rank": args.stages_per_rank,
            "bubble_theory": round(bubble_theory(layout.pp, args.n_microbatches, args.stages_per_rank), 4),
            "bubble_measured_per_rank": [
                None if per_stage[r][1] < 0 else round(1 - float(per_stage[r][1]), 4) for r in ranks
            ],
            "max_microbatches_in_flight_per_rank": [int(per_stage[r][2]) for r in ranks],
            "activation_mib_per_microbatch_per_rank": [round(float(per_stage[r][3]) / 2**20, 4) for r in ranks],
            "peak_activation_mib_per_rank": [round(float(per_stage[r][4]) / 2**20, 4) for r in ranks],
        }


def count_storage(t: torch.Tensor, storages: dict) -> torch.Tensor:
    """A saved-tensors hook: every tensor autograd keeps for backward, each storage counted once."""
    local = t.to_local() if isinstance(t, DTensor) else t
    try:
        storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    except RuntimeError:  # no storage of its own (a wrapper subclass): its size
        storages[id(t)] = local.numel() * local.element_size()
    return t
