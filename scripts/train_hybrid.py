#!/usr/bin/env python
"""Hybrid parallelism on one device mesh: pipeline x data (FSDP/HSDP) x tensor parallel.

How GPT-3-class models are trained: every strategy splits along its own mesh dimension, and
they compose because each one talks only inside its own groups:

    8 ranks: --pp_size 2 --dp_shard 2 --tp_size 2            tp groups:  {0,1} {2,3} {4,5} {6,7}
                      dp_shard 0        dp_shard 1           dp groups:  {0,2} {1,3} {4,6} {5,7}
        pp stage 0:  [ rank 0 | 1 ]    [ rank 2 | 3 ]        pp groups:  {0,4} {1,5} {2,6} {3,7}
        pp stage 1:  [ rank 4 | 5 ]    [ rank 6 | 7 ]
                      └ tp ┘
    - pp: stage 0 holds layers 0..L/2-1 and the embeddings, stage 1 the rest and the head;
      activations go 0 -> 1, gradients 1 -> 0 (send/recv between pp peers)
    - tp: inside [ | ], each weight matrix is split in two (all-reduces inside the pair, every layer)
    - dp: the two columns train on different halves of the batch; FSDP shards each stage's
      (already TP-split) weights between them (all-gather / reduce-scatter per block)
    - dp_replicate x dp_shard = HSDP: shard inside a group, replicate across groups

Choosing a layout: TP inside a node (it talks every layer), PP across nodes (it sends only
activations, once per stage boundary), FSDP/DP over the rest.

Run it:
    accelerate launch --config_file accelerate_configs/cpu_multi.yaml --num_processes 4 scripts/train_hybrid.py --dp_shard 2 --tp_size 2
    accelerate launch ... --num_processes 8 scripts/train_hybrid.py --n_layer 4 --pp_size 2 --dp_shard 2 --tp_size 2
Strategies are applied in a fixed order (split into stages, then TP, then activation
checkpointing, then FSDP), by the same functions the single-strategy scripts use.
A checkpoint saved by any script and layout resumes under any other (same model, same global batch).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts run as files: make `common` importable

from accelerate.utils import set_seed  # noqa: E402

from common.launch import build_parser, run_main  # noqa: E402
from common.loop import PipelineStep, Run, add_pipeline_args, check_pipeline_args, check_pipeline_flags, check_tp_flags, pipeline_summary, sharded_step  # noqa: E402
from common.model import GPT  # noqa: E402
from common.parallel import apply_activation_checkpointing, apply_fsdp, apply_tensor_parallel, split_pipeline  # noqa: E402


def check_hybrid_flags(run: Run, args) -> None:
    check_tp_flags(run, args.sequence_parallel, args.loss_parallel)
    if run.layout.pp > 1:
        check_pipeline_flags(run, args)


def main():
    parser = build_parser(__doc__)
    g = parser.add_argument_group("layout (the product must equal the number of processes; one may be -1: inferred)")
    g.add_argument("--pp_size", type=int, default=1, help="pipeline stages")
    g.add_argument("--dp_replicate", type=int, default=1, help="data-parallel replicas (HSDP: replicate across them)")
    g.add_argument("--dp_shard", type=int, default=-1, help="data-parallel ranks that shard the model (FSDP)")
    g.add_argument("--tp_size", type=int, default=1, help="ranks per tensor-parallel group")
    g = parser.add_argument_group("tensor parallel and memory")
    g.add_argument("--sequence_parallel", action="store_true", help="TP: shard norms/dropout along the sequence")
    g.add_argument("--loss_parallel", action="store_true", help="TP: cross-entropy on vocabulary-sharded logits")
    g.add_argument("--activation_checkpointing", action="store_true", help="recompute each block's activations in backward")
    add_pipeline_args(parser)
    args = parser.parse_args()
    args.output_dir = args.output_dir or "runs/hybrid"
    check_pipeline_args(args)
    # Accelerator, layout (checked once: product = world size, TP divides heads, PP <= layers), data
    run = Run(args, "train_hybrid", stages_per_rank=args.stages_per_rank, pp=args.pp_size, dp_replicate=args.dp_replicate,
              dp_shard=args.dp_shard, tp=args.tp_size, check=lambda run: check_hybrid_flags(run, args))
    layout, accelerator = run.layout, run.accelerator

    set_seed(args.seed)  # Accelerate: the same full model on every rank before any cut: init independent of the layout
    model = GPT(run.model_config).to(accelerator.device)

    # ---------------------------------------------------------------- the hybrid strategy, in torchtitan's order
    stages = split_pipeline(model, layout, args.stages_per_rank, args.split_points) if layout.pp > 1 else None  # 1. PP
    if layout.tp > 1:                                                                                           # 2. TP
        apply_tensor_parallel(model, layout.sub("tp"), args.sequence_parallel, args.loss_parallel)
    if args.activation_checkpointing:                                                                           # 3. AC
        apply_activation_checkpointing(model)
    if layout.dp > 1:                                                                                           # 4. FSDP/HSDP
        apply_fsdp(model, stages or [model], layout.fsdp_mesh, accelerator.mixed_precision)
    if layout.pp > 1:
        pipeline = PipelineStep(accelerator, layout, stages, args.schedule, args.n_microbatches, args.loss_parallel)
        forward_backward, predict = pipeline, pipeline.predict
    else:
        forward_backward, predict = sharded_step(accelerator, model, layout, args.loss_parallel)
    # ----------------------------------------------------------------------------------------------

    run.train(model, forward_backward, predict, eval_batch_size=args.batch_size if layout.pp > 1 else None, strategy_lines=[
        f"order: {' -> '.join(name for name, on in (('pipeline split', layout.pp > 1), ('tensor parallel', layout.tp > 1), ('activation checkpointing', args.activation_checkpointing), ('HSDP' if layout.dp_replicate > 1 else 'FSDP', layout.dp > 1)) if on) or 'none (one process)'}",
    ], extra_summary=(lambda: pipeline_summary(run, pipeline, args)) if layout.pp > 1 else None)


if __name__ == "__main__":
    run_main(main)
