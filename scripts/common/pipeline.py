"""Pipeline arithmetic: which units each stage holds, which stages each rank holds, the bubble, and
the pipeline flags. Model-agnostic and free of torch.distributed.pipelining, so that the planner
(plan_layout.py) costs a layout with the same rules the training scripts run it with.

The model's repeated units (Task.units: blocks, decoder layers) are cut into pp x v stages,
balanced by count (earlier stages take the remainder) or before each index of --split_points.
Looped placement: rank r holds stages r, r + pp, r + 2pp ... (what the interleaved schedules expect):

    8 units, pp 2, v 2 (--stages_per_rank 2): 4 stages of 2 units
        stage:  0        1        2        3
        units:  0 1      2 3      4 5      6 7
        rank:   0        1        0        1         rank 0: stages 0, 2;  rank 1: stages 1, 3
    a micro-batch goes rank 0 -> 1 -> 0 -> 1: each rank works twice per micro-batch, on half the
    units, so the fill and drain are half as long: bubble (p-1)/(v*m+p-1) for m micro-batches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import UsageError

if TYPE_CHECKING:
    from .layout import Layout

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "zero_bubble")  # several stages per rank


def stage_layers(n_units: int, n_stages: int, split_points: list[int] | None = None) -> list[range]:
    """The units of each stage: balanced by count (earlier stages take the remainder), or cut
    before each unit index in `split_points`."""
    if split_points:
        cuts = [0, *split_points, n_units]
    else:
        base, extra = divmod(n_units, n_stages)
        cuts = [0]
        for s in range(n_stages):
            cuts.append(cuts[-1] + base + (1 if s < extra else 0))
    return [range(a, b) for a, b in zip(cuts, cuts[1:], strict=False)]


def stages_of_rank(pp_rank: int, pp_size: int, stages_per_rank: int) -> list[int]:
    """Looped placement: rank r holds stages r, r + pp, r + 2pp ... (what the interleaved
    schedules expect)."""
    return [pp_rank + k * pp_size for k in range(stages_per_rank)]


def bubble_theory(pp: int, n_microbatches: int, stages_per_rank: int = 1) -> float:
    """Idle fraction of GPipe/1F1B: (p-1)/(m+p-1); interleaving v stages per rank divides the
    bubble's length by v: (p-1)/(v*m+p-1)."""
    return (pp - 1) / (stages_per_rank * n_microbatches + pp - 1)


def add_pipeline_args(parser):
    g = parser.add_argument_group("pipeline parallel")
    g.add_argument("--schedule", default="1f1b", help=f"pipeline schedule: {' | '.join(SCHEDULES)}")
    g.add_argument("--n_microbatches", type=int, default=4, help="micro-batches each --batch_size is split into")
    g.add_argument(
        "--stages_per_rank",
        type=int,
        help="stages each rank holds (default: 2 for interleaved_1f1b and zero_bubble, else 1)",
    )
    g.add_argument(
        "--split_points",
        help="comma-separated unit (layer) indices where a new stage begins, e.g. 1,3 (default: balance the units "
        "by count)",
    )
    return g


def parse_pipeline_flags(args) -> None:
    """The pipeline flags alone, before any process group exists: the schedule, --stages_per_rank
    (its default filled in), --n_microbatches, --split_points (parsed into a list, or None)."""
    if args.schedule not in SCHEDULES:
        raise UsageError(f"--schedule {args.schedule!r} is not supported: choose {', '.join(SCHEDULES)}")
    if args.stages_per_rank is None:
        args.stages_per_rank = 2 if args.schedule in MULTI_STAGE_SCHEDULES else 1
    if args.stages_per_rank < 1:
        raise UsageError(f"--stages_per_rank must be at least 1 (got {args.stages_per_rank})")
    if args.stages_per_rank > 1 and args.schedule not in MULTI_STAGE_SCHEDULES:
        raise UsageError(
            f"--stages_per_rank {args.stages_per_rank}: --schedule {args.schedule} runs one stage per rank; "
            "use interleaved_1f1b or zero_bubble, or drop --stages_per_rank"
        )
    if args.n_microbatches < 1:
        raise UsageError(f"--n_microbatches must be at least 1 (got {args.n_microbatches})")
    if args.split_points:
        try:
            args.split_points = [int(x) for x in str(args.split_points).split(",")]
        except ValueError:
            raise UsageError(
                f"--split_points {args.split_points!r}: give comma-separated unit indices, e.g. 1,3"
            ) from None
    else:
        args.split_points = None


def check_pipeline_layout(layout: Layout, n_units: int, args, units_name: str = "repeated units") -> None:
    """The pipeline flags against the layout (pipeline ranks) and the model (its `n_units` repeated
    units, `units_name` saying what they are): every stage gets a unit, the batch splits into the
    micro-batches, the schedule has enough micro-batches in flight."""
    n_stages = layout.pp * args.stages_per_rank
    if n_stages > n_units:
        raise UsageError(
            f"--pp_size {layout.pp} x --stages_per_rank {args.stages_per_rank} = {n_stages} stages, but the model "
            f"has {n_units} units ({units_name}): every stage needs at least one; use fewer stages or a model with "
            "more units"
        )
    if args.batch_size % args.n_microbatches:
        raise UsageError(
            f"--batch_size {args.batch_size} cannot be split into --n_microbatches {args.n_microbatches} equal "
            "micro-batches: use a batch size divisible by it"
        )
    if args.gradient_accumulation_steps != 1:
        raise UsageError(
            "--gradient_accumulation_steps: the pipeline already accumulates over its micro-batches; raise "
            "--batch_size and --n_microbatches instead (and keep accumulation 1)"
        )
    if args.split_points is not None:
        points = args.split_points
        if len(points) != n_stages - 1 or points != sorted(set(points)) or points[0] <= 0 or points[-1] >= n_units:
            raise UsageError(
                f"--split_points {','.join(map(str, points))}: {n_stages} stages need {n_stages - 1} increasing "
                f"unit indices between 1 and {n_units - 1}"
            )
    if layout.pp > 1 and args.schedule != "gpipe" and args.n_microbatches < layout.pp:
        raise UsageError(
            f"--n_microbatches {args.n_microbatches} is fewer than the {layout.pp} pipeline ranks: --schedule "
            f"{args.schedule} needs at least one micro-batch per rank in flight (raise --n_microbatches, or use gpipe)"
        )
    if args.schedule in MULTI_STAGE_SCHEDULES and args.n_microbatches % layout.pp:
        raise UsageError(
            f"--n_microbatches {args.n_microbatches}: --schedule {args.schedule} needs a multiple of the "
            f"{layout.pp} pipeline ranks"
        )
