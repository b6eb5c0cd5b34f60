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
    accelerate launch --config_file accelerate_configs/cpu_multi.yaml --num_processes 4 \\
        scripts/train_hybrid.py --dp_shard 2 --tp_size 2
    accelerate launch ... --num_processes 8 scripts/train_hybrid.py --n_layer 4 --pp_size 2 --dp_shard 2 --tp_size 2
Strategies are applied in a fixed order (split into stages, then TP, then activation
checkpointing, then FSDP), by the functions imported from train_pp.py, train_tp.py and
train_fsdp.py: this file holds the mesh and the order, no strategy code of its own.
A checkpoint saved by any script and layout resumes under any other (same model, same global batch).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts run as files: make `common` importable

import torch
from accelerate.utils import set_seed

from common.checkpoint import check_resume_and_output, export_model, load_checkpoint, save_checkpoint
from common.data import data_source, load_data, make_train_loader
from common.launch import build_parser, check_core_args, make_accelerator, run_main
from common.layout import Layout
from common.metrics import (
    CollectiveCounter,
    RunLog,
    evaluate_sharded,
    first_step_line,
    sharded_start_lines,
    sharded_summary,
    training_state_bytes,
)
from common.model import GPT, count_parameters
from common.training import (
    TrainStream,
    clip_grad_norm_,
    compile_blocks,
    make_optimizer,
    make_scheduler,
    model_config_from_args,
    shard_loader,
    trainer_state,
)
from train_fsdp import apply_activation_checkpointing, apply_fsdp
from train_pp import PipelineStep, add_pipeline_args, check_pipeline_args, check_pipeline_flags, split_pipeline
from train_tp import apply_tensor_parallel, check_tp_flags, tp_forward_backward


def main():
    # ---------------------------------------- flags
    parser = build_parser(__doc__)
    g = parser.add_argument_group("layout (the product must equal the number of processes; one may be -1: inferred)")
    g.add_argument("--pp_size", type=int, default=1, help="pipeline stages")
    g.add_argument("--dp_replicate", type=int, default=1, help="data-parallel replicas (HSDP: replicate across them)")
    g.add_argument("--dp_shard", type=int, default=-1, help="data-parallel ranks that shard the model (FSDP)")
    g.add_argument("--tp_size", type=int, default=1, help="ranks per tensor-parallel group")
    g = parser.add_argument_group("tensor parallel and memory")
    g.add_argument("--sequence_parallel", action="store_true", help="TP: shard norms/dropout along the sequence")
    g.add_argument("--loss_parallel", action="store_true", help="TP: cross-entropy on vocabulary-sharded logits")
    g.add_argument(
        "--activation_checkpointing", action="store_true", help="recompute each block's activations in backward"
    )
    add_pipeline_args(parser)
    args = parser.parse_args()
    args.output_dir = args.output_dir or "runs/hybrid"
    check_core_args(args)
    check_pipeline_args(args)
    model_config = model_config_from_args(args)

    # ---------------------------------------- Accelerator and layout
    # Accelerate: process group (gloo on CPU, NCCL on GPU), device, mixed precision from the launcher;
    # the scheduler counts optimizer steps, whatever the layout.
    accelerator = make_accelerator(args, sharded="train_hybrid", step_scheduler_with_optimizer=False)
    # one object holds the degrees, checked once: product = world size, TP divides heads, PP <= layers
    layout = Layout.from_degrees(
        accelerator.num_processes,
        pp=args.pp_size,
        dp_replicate=args.dp_replicate,
        dp_shard=args.dp_shard,
        tp=args.tp_size,
    )
    layout.check_model(model_config, args.stages_per_rank)
    if layout.pp > 1:
        check_pipeline_flags(layout, model_config.n_layer, args)
    global_batch_size = args.batch_size * layout.dp * args.gradient_accumulation_steps

    # ---------------------------------------- data (checked before anything is written)
    data = load_data(args, accelerator, model_config.block_size)
    train_loader = make_train_loader(data.train, args.batch_size, global_batch_size, args.seed)
    check_tp_flags(layout, data.seq_len, data.task, args.sequence_parallel, args.loss_parallel)
    resume_path = check_resume_and_output(accelerator, args, model_config, global_batch_size)
    layout.build_mesh(accelerator.device.type)

    # ---------------------------------------- model
    set_seed(args.seed)  # Accelerate: the same full model on every rank before any cut: init independent of the layout
    model = GPT(model_config).to(accelerator.device)
    n_params = count_parameters(model)

    # ---------------------------------------- the strategies, in torchtitan's order
    stages = split_pipeline(model, layout, args.stages_per_rank, args.split_points) if layout.pp > 1 else None  # 1. PP
    if layout.tp > 1:
        apply_tensor_parallel(model, layout.sub("tp"), args.sequence_parallel, args.loss_parallel)  # 2. TP
    if args.activation_checkpointing:
        apply_activation_checkpointing(model)  # 3. activation checkpointing
    if args.compile:
        compile_blocks(model, accelerator)  # 4. torch.compile per block
    if layout.dp > 1:
        # under PP the weights stay gathered for the whole step: one all-gather, not one per micro-batch
        reshard = layout.pp == 1
        apply_fsdp(model, stages or [model], layout.fsdp_mesh, accelerator.mixed_precision, reshard)  # 5. FSDP / HSDP
    if layout.pp > 1:
        pipeline = PipelineStep(accelerator, layout, stages, args.schedule, args.n_microbatches, args.loss_parallel)
        forward_backward, predict, eval_batch_size = pipeline, pipeline.predict, args.batch_size
    else:

        def forward_backward(window, global_targets):
            return tp_forward_backward(accelerator, model, window, global_targets, layout.dp, args.loss_parallel)

        predict, eval_batch_size = model, args.eval_batch_size

    # ---------------------------------------- optimizer (after every cut: it sees the shards)
    optimizer = make_optimizer(model, args)
    scheduler = make_scheduler(optimizer, args)
    # Accelerate: optimizer/scheduler wrappers (not the model: each strategy owns it);
    # the loader is sharded over the data-parallel ranks only
    optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
    train_sampler = train_loader.sampler
    train_loader = shard_loader(train_loader, accelerator, layout)
    progress = load_checkpoint(accelerator, resume_path, model, optimizer, scheduler)  # step 0 without a checkpoint
    stream = TrainStream(
        accelerator,
        train_loader,
        train_sampler,
        global_batch_size,
        args.gradient_accumulation_steps,
        progress,
        dp_group=layout.group("dp"),
    )

    # ---------------------------------------- the training loop
    step = start_step = progress["step"]
    log = RunLog(accelerator, args, "train_hybrid", step, layout.world_size, global_batch_size)
    applied = (
        ("pipeline split", layout.pp > 1),
        ("tensor parallel", layout.tp > 1),
        ("activation checkpointing", args.activation_checkpointing),
        ("HSDP" if layout.dp_replicate > 1 else "FSDP", layout.dp > 1),
    )
    order = " -> ".join(name for name, on in applied if on) or "none (one process)"
    costs = sharded_start_lines(model, layout, n_params, args.optimizer, accelerator)
    log.start(model_config, n_params, data, [f"order: {order}", costs], resume_path, layout)
    state_bytes, comm = {}, {}  # measured on the first step
    model.train()
    while step < min(args.max_steps, args.stop_at_step or args.max_steps) and not stream.preempted:
        log.step_start()
        window, global_targets = stream.next_step()
        # the first step's collectives are counted (not under --compile: a dispatch mode stops it)
        with CollectiveCounter(enabled=step == start_step and not args.compile) as counter:
            loss_sum = forward_backward(window, global_targets)
        # sharded, and summed over the stages
        grad_norm = clip_grad_norm_(model.parameters(), args.max_grad_norm, layout.group("pp"))
        lr = scheduler.get_last_lr()[0]
        optimizer.step()  # each rank updates what it holds
        scheduler.step()
        if step == start_step:
            state_bytes, comm = training_state_bytes(model, optimizer), counter.report()
            log.write(first_step_line(state_bytes, comm))
        optimizer.zero_grad(set_to_none=True)
        step += 1
        log.step_end()

        if log.is_log_step(step):
            # one rank per data-parallel replica (last stage, TP rank 0) counts its loss sum
            loss_sum = loss_sum if layout.holds_loss else torch.zeros_like(loss_sum)
            loss = (accelerator.reduce(loss_sum, reduction="sum") / global_targets).item()  # Accelerate: all-reduce
            log.train(step, loss, lr, grad_norm, epoch=stream.epoch)
        if log.is_eval_step(step):
            model.eval()
            result = evaluate_sharded(accelerator, predict, data.validation, eval_batch_size, layout, data.task)
            model.train()
            log.eval(step, result)
        if log.is_checkpoint_step(step) or stream.preempted:  # preempted: every rank saves
            state = trainer_state(step, stream, args, model_config, global_batch_size, layout.world_size, layout)
            # every rank writes its part (a collective)
            save_checkpoint(accelerator, model, optimizer, scheduler, state, args.output_dir, args.keep_last)
    stream.close()

    # ---------------------------------------- save
    if step == args.max_steps:  # every rank: gathers shards; one rank per stage sends its layers
        export_model(accelerator, model, model_config, data_source(args), Path(args.output_dir) / "model", layout)
    costs = sharded_summary(accelerator, layout, n_params, args.optimizer, state_bytes, comm)
    log.summary(step, preempted=stream.preempted, **costs, **(pipeline.summary(args) if layout.pp > 1 else {}))
    accelerator.wait_for_everyone()
    accelerator.end_training()  # Accelerate: closes trackers, destroys the process group


if __name__ == "__main__":
    run_main(main)
