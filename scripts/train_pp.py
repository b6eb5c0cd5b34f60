#!/usr/bin/env python
"""Pipeline parallelism with torch.distributed.pipelining, under 🤗 Accelerate.

The model is cut by layers into stages, one per rank (embeddings with the first blocks, final
norm and head with the last). Activations flow forward from stage to stage and gradients flow
back. To keep every stage busy, each batch is split into micro-batches that follow each other
through the pipe; the schedule decides the order:

    GPipe, 4 stages, 4 micro-batches (F = forward, B = backward, . = idle: the bubble)
    stage 0: F0 F1 F2 F3 .  .  .  .  .  .  B3 B2 B1 B0
    stage 1: .  F0 F1 F2 F3 .  .  .  .  B3 B2 B1 B0 .
    stage 2: .  .  F0 F1 F2 F3 .  .  B3 B2 B1 B0 .  .
    stage 3: .  .  .  F0 F1 F2 F3 B3 B2 B1 B0 .  .  .      every stage holds 4 micro-batches' activations

    1F1B: same bubble, but each stage starts backward as soon as it can, so it holds at most
    (stages - its index) micro-batches' activations instead of all of them
    stage 0: F0 F1 F2 F3 .  .  .  B0 .  B1 .  B2 .  B3
    stage 3: .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .  .

    bubble (idle fraction) of both: (p - 1) / (m + p - 1) for p stages and m micro-batches.
    interleaved 1F1B (--stages_per_rank 2): each rank holds 2 smaller stages, bubble / 2.
    zero bubble: backward split into input-gradient and weight-gradient parts; the weight parts fill the bubble.

Run it:
    accelerate launch --config_file accelerate_configs/cpu_multi.yaml scripts/train_pp.py --pp_size 2 --schedule 1f1b
    accelerate launch ... --num_processes 4 scripts/train_pp.py --n_layer 8 --schedule interleaved_1f1b --n_microbatches 8
--batch_size is the per-replica batch the schedule splits into --n_microbatches (use it instead
of gradient accumulation); evaluation runs through the pipeline with the same batch shape.
With --pp_size smaller than the number of processes, the remaining factor trains data parallel (FSDP).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts run as files: make `common` importable

from accelerate.utils import set_seed  # noqa: E402

from common.launch import build_parser, run_main  # noqa: E402
from common.loop import PipelineStep, Run, add_pipeline_args, check_pipeline_args, check_pipeline_flags, pipeline_summary  # noqa: E402
from common.model import GPT  # noqa: E402
from common.parallel import apply_fsdp, bubble_theory, split_pipeline, stage_layers  # noqa: E402


def main():
    parser = build_parser(__doc__)
    g = add_pipeline_args(parser)
    g.add_argument("--pp_size", type=int, default=-1, help="pipeline stages (ranks per pipeline; -1: all processes)")
    args = parser.parse_args()
    args.output_dir = args.output_dir or "runs/pp"
    check_pipeline_args(args)
    # Accelerator, layout (pp x the rest as data parallel), data; every check before anything is written
    run = Run(args, "train_pp", stages_per_rank=args.stages_per_rank, pp=args.pp_size, dp_shard=1 if args.pp_size == -1 else -1,
              check=lambda run: check_pipeline_flags(run, args))
    layout = run.layout

    set_seed(args.seed)  # Accelerate: the same full model on every rank before it is cut: init independent of the layout
    model = GPT(run.model_config).to(run.accelerator.device)

    # ---------------------------------------------------------------- the pipeline strategy
    # keep this rank's layers (the rest is deleted) and view them as stages; names stay the full model's
    stages = split_pipeline(model, layout, args.stages_per_rank, args.split_points)
    if layout.dp > 1:  # processes beyond one pipeline: data parallel over the pipelines (FSDP per stage)
        apply_fsdp(model, stages, layout.fsdp_mesh, run.accelerator.mixed_precision)
    pipeline = PipelineStep(run.accelerator, layout, stages, args.schedule, args.n_microbatches)
    # ----------------------------------------------------------------------------------------------

    n_stages = layout.pp * args.stages_per_rank
    layers = stage_layers(run.model_config.n_layer, n_stages, args.split_points)
    run.train(model, pipeline, pipeline.predict, eval_batch_size=args.batch_size, strategy_lines=[
        f"pipeline: {n_stages} stages ({', '.join(f'{s}: layers {r.start}-{r.stop - 1}' for s, r in enumerate(layers))}), "
        f"schedule {args.schedule}, {args.n_microbatches} micro-batches of {args.batch_size // args.n_microbatches}",
        f"bubble in theory: (p-1)/(v*m+p-1) = {bubble_theory(layout.pp, args.n_microbatches, args.stages_per_rank):.3f}; measured in the summary",
    ], extra_summary=lambda: pipeline_summary(run, pipeline, args))


if __name__ == "__main__":
    run_main(main)
