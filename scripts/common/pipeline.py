"""The pipeline's stage split: which units each stage holds (stage_layers), which stages each rank holds
(stages_of_rank), and the pipeline flags parsed (parse_pipeline_flags). Model-agnostic and free of
torch.distributed.pipelining, so that the planner (plan_layout.py) costs a layout with the same rules
the training scripts run it with. What a pipeline costs is common/pp_costs.py's, its refusals
common/pp_checks.py's.

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

from .errors import UsageError

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
