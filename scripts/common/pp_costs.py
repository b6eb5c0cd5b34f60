"""What a pipeline costs: the start lines (the stages, the schedule, the bubble in theory) and what
the schedule measures on each rank (TimedStage, ScheduleMeter): the time it computes, the
micro-batches whose activations it holds at once, the bytes autograd saves for one of them; the
summary's figures. And the base of the lesson's PipelineStep (PipelineStepBase): the schedule run
forward only, for evaluation, and its figures for the summary.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

from .pipeline import bubble_theory, stage_layers

if TYPE_CHECKING:
    from .layout import Layout


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


class TimedStage(PipelineStage):
    """torch's PipelineStage, measuring what the schedule costs this rank: the time it computes
    (forward, backward, weight gradients), the most micro-batches whose activations it holds at
    once, and the bytes autograd saves for one micro-batch's backward."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.activation_bytes = None  # measured once, at the first forward with gradients
        self.reset_counters()

    def reset_counters(self) -> None:
        self.busy_s, self.max_in_flight = 0.0, 0

    def forward_one_chunk(self, *args, **kwargs):
        start = time.perf_counter()
        measure = self.activation_bytes is None and torch.is_grad_enabled()
        storages: dict[int, int] = {}

        def pack(t):  # every tensor autograd keeps for backward, each storage counted once
            local = t.to_local() if isinstance(t, DTensor) else t
            try:
                storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
            except RuntimeError:  # no storage of its own (a wrapper subclass): its size
                storages[id(t)] = local.numel() * local.element_size()
            return t

        try:
            if measure:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    return super().forward_one_chunk(*args, **kwargs)
            return super().forward_one_chunk(*args, **kwargs)
        finally:
            self.busy_s += time.perf_counter() - start
            if torch.is_grad_enabled():
                self.max_in_flight = max(self.max_in_flight, len(self.fwd_cache))
            if measure:
                self.activation_bytes = sum(storages.values())

    def backward_one_chunk(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return super().backward_one_chunk(*args, **kwargs)
        finally:
            self.busy_s += time.perf_counter() - start

    def backward_weight_one_chunk(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return super().backward_weight_one_chunk(*args, **kwargs)
        finally:
            self.busy_s += time.perf_counter() - start


class ScheduleMeter:
    """This rank's TimedStages over the run: the time they computed against the steps' time (the
    measured bubble), the most micro-batches in flight; the summary's figures per pipeline rank."""

    def __init__(self, stages: list[TimedStage]):
        self.stages = stages
        self.busy_s = self.step_s = 0.0
        self.max_in_flight, self.steps = 0, 0

    @contextmanager
    def timed(self):
        """Around one step's schedule.step."""
        for stage in self.stages:
            stage.reset_counters()
        start = time.perf_counter()
        yield
        if self.steps > 0:  # the first step also sets up the stages: not in the bubble
            self.step_s += time.perf_counter() - start
            self.busy_s += sum(stage.busy_s for stage in self.stages)
        self.max_in_flight = max([self.max_in_flight, *(stage.max_in_flight for stage in self.stages)])
        self.steps += 1

    def summary(self, accelerator, layout: Layout, args) -> dict:
        """Per stage (pipeline rank): measured bubble, micro-batches in flight, activation memory;
        beside the theory. Collective (a gather)."""
        busy = self.busy_s / self.step_s if self.step_s else -1.0
        act = max((stage.activation_bytes or 0) for stage in self.stages)
        row = torch.tensor(
            [layout.pp_rank, busy, self.max_in_flight, act, act * self.max_in_flight],
            dtype=torch.float64,
            device=accelerator.device,
        )
        rows = accelerator.gather(row[None]).cpu()  # Accelerate: all-gather
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


class PipelineStepBase:
    """What the lesson's PipelineStep (train_pp.py, and train_hybrid.py's) does besides its training
    step: forward only through the schedule, for evaluate() (predict), and the figures of the
    schedule it ran, for the summary. It reads what PipelineStep sets: accelerator, layout,
    schedule, has_first, has_last, scoring, loss_context, meter (its ScheduleMeter)."""

    def predict(self, *inputs):
        """Forward only (evaluate's `predict`): the last stage gets the whole batch's outputs, the
        others None. The schedule's loss_fn scores nothing; the first input stands in for targets."""
        target = inputs[0] if self.has_last else None
        inputs = tuple(x for x in inputs if x is not None) if self.has_first else ()  # no None mask
        self.scoring = False
        try:
            with self.loss_context():
                outputs = self.schedule.eval(*inputs, target=target)
        finally:
            self.scoring = True
        return outputs if self.has_last else None

    def summary(self, args) -> dict:
        """Per pipeline rank: the measured bubble, micro-batches in flight, activation memory."""
        return self.meter.summary(self.accelerator, self.layout, args)
