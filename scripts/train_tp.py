#!/usr/bin/env python
"""Tensor parallelism (Megatron-style) with PyTorch DTensor, under 🤗 Accelerate.

Every weight matrix of a block is cut across the ranks of a TP group; all of them see the same
batch and together compute one layer. Column-parallel layers split their outputs (attention
heads, MLP columns), row-parallel ones their inputs, so each pair needs one all-reduce:

    one block, tp = 2 (x: activations, replicated on both ranks)
                   rank 0                            rank 1
    f ->  q,k,v[:, heads 0..h/2)   attention    q,k,v[:, heads h/2..h)   attention     column-wise
          o_proj[heads 0..h/2 , :]  -> partial  o_proj[heads h/2..h, :]  -> partial    row-wise
    g ->                 all-reduce(partial + partial) = attention output
    f ->  up_proj[:, cols 0..2d)       GELU     up_proj[:, cols 2d..4d)      GELU      column-wise
          down_proj[cols 0..2d, :] -> partial   down_proj[cols 2d..4d, :] -> partial   row-wise
    g ->                 all-reduce = MLP output

    f: identity forward, all-reduce of the input gradient backward;  g: all-reduce forward, identity backward.
    Embedding: vocab rows split (each rank looks up the tokens it holds, partial sums all-reduced).
    LM head: vocab columns split; --loss_parallel computes the cross-entropy on the shards.
    --sequence_parallel: LayerNorms and dropout work on a slice of the sequence; each all-reduce
    becomes an all-gather (before attention/MLP) plus a reduce-scatter (after them).

Run it:
    accelerate launch --config_file accelerate_configs/cpu_multi.yaml scripts/train_tp.py --tp_size 2
    accelerate launch --config_file accelerate_configs/gpu_multi.yaml scripts/train_tp.py \\
        --tp_size 8 --sequence_parallel --loss_parallel
With --tp_size smaller than the number of processes, the remaining factor trains data parallel
(FSDP, with `apply_fsdp` from train_fsdp.py), as in train_hybrid.py.
Lines marked `# TP:` are the strategy; `# Accelerate:` the library's part.
"""

import sys
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts run as files: make `common` importable

import torch
from accelerate.utils import set_seed
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from common.checkpoint import check_resume_and_output, export_model, load_checkpoint, save_checkpoint
from common.data import data_source, load_data, make_train_loader
from common.errors import UsageError
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
from common.model import GPT, count_parameters, cross_entropy_sum
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
from train_fsdp import apply_fsdp


# ======================================== TP: the strategy
def tensor_parallel_plan(model: GPT, sequence_parallel: bool, loss_parallel: bool) -> dict:
    """Megatron's split, as a parallelize_module plan (only for the parts this rank holds).

    Per block: q/k/v column-wise (each rank computes n_head/tp heads), o_proj row-wise;
    up_proj column-wise, down_proj row-wise. One all-reduce after o_proj and one after
    down_proj in forward (Megatron's g), one each at the block's inputs in backward (f).
    With sequence parallel the norms work on a slice of the sequence, and each all-reduce
    becomes an all-gather before attention/MLP plus a reduce-scatter after them."""
    seq = Shard(1)  # the sequence dimension of (batch, seq, hidden)
    between_blocks = seq if sequence_parallel else Replicate()
    plan = {}
    if model.tok_emb is not None:  # vocab-parallel: each rank holds vocab/tp rows; partial sums are reduced
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between_blocks)
        if sequence_parallel:  # positions of this rank's sequence slice, to add to its token slice
            plan["pos_emb"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
    for name in model.blocks:
        b = f"blocks.{name}"
        plan.update(
            {
                f"{b}.attn.q_proj": ColwiseParallel(),
                f"{b}.attn.k_proj": ColwiseParallel(),
                f"{b}.attn.v_proj": ColwiseParallel(),
                f"{b}.attn.o_proj": RowwiseParallel(output_layouts=between_blocks),
                f"{b}.mlp.up_proj": ColwiseParallel(),
                f"{b}.mlp.down_proj": RowwiseParallel(output_layouts=between_blocks),
                # attention and MLP take their input as one replicated DTensor (all-gathered from the sequence
                # slices under SP): q, k and v share it, so backward reduces its gradient once, not 3 times
                f"{b}.attn": PrepareModuleInput(input_layouts=(between_blocks,), desired_input_layouts=(Replicate(),)),
                f"{b}.mlp": PrepareModuleInput(input_layouts=(between_blocks,), desired_input_layouts=(Replicate(),)),
            }
        )
        if sequence_parallel:
            plan.update({f"{b}.ln_1": SequenceParallel(), f"{b}.ln_2": SequenceParallel()})
    if model.lm_head is not None:
        if sequence_parallel:
            plan["ln_f"] = SequenceParallel()
        # loss parallel: keep the logits sharded over the vocabulary; the loss is computed on the shards
        plan["lm_head"] = ColwiseParallel(
            input_layouts=between_blocks,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    return plan


def apply_tensor_parallel(model: GPT, tp_mesh, sequence_parallel: bool = False, loss_parallel: bool = False) -> None:
    """parallelize_module swaps each weight for a DTensor shard and adds the f/g collectives as hooks."""
    parallelize_module(model, tp_mesh, tensor_parallel_plan(model, sequence_parallel, loss_parallel))


def tp_forward_backward(
    accelerator, model, window: list, global_targets: torch.Tensor, dp_size: int, use_loss_parallel: bool
) -> torch.Tensor:
    """Forward and backward of this rank's micro-batches (the whole TP group runs the same ones);
    returns their loss sum. Normalised by the global batch's target count, times dp because the
    data-parallel part (FSDP) averages gradients over the dp ranks."""
    step_loss_sum = torch.zeros((), device=accelerator.device)
    for i, mb in enumerate(window):
        if isinstance(model, FSDPModule):  # data parallel beside TP: one reduce-scatter, after the last micro-batch
            model.set_requires_gradient_sync(i == len(window) - 1)
        with (
            accelerator.autocast(),
            loss_parallel() if use_loss_parallel else nullcontext(),
        ):  # TP: loss on vocab shards
            loss_sum, _ = cross_entropy_sum(model(mb["input_ids"]), mb["labels"])
            accelerator.backward(loss_sum * dp_size / global_targets)  # Accelerate: backward
        step_loss_sum += loss_sum.detach().full_tensor() if isinstance(loss_sum, DTensor) else loss_sum.detach()
    return step_loss_sum


def check_tp_flags(layout: Layout, seq_len: int, task: str, sequence_parallel: bool, loss_parallel: bool) -> None:
    """--sequence_parallel / --loss_parallel need a TP group; sequence parallel also needs every
    rank to get an equal slice of the sequence (docs/troubleshooting.md, "Sequence parallel needs
    a divisible sequence length")."""
    if layout.tp == 1 and (sequence_parallel or loss_parallel):
        flag = "sequence_parallel" if sequence_parallel else "loss_parallel"
        raise UsageError(
            f"--{flag} shards over the TP group, but --tp_size is 1: use --tp_size 2 or more, or drop --{flag}"
        )
    if sequence_parallel and seq_len % layout.tp:
        hint = (
            "choose --addition_digits d with 3d+4 divisible by it (d = 4 gives 16 tokens)"
            if task == "addition"
            else "use a --block_size divisible by it"
        )
        raise UsageError(
            f"--sequence_parallel splits the {seq_len}-token sequence over --tp_size {layout.tp} ranks, "
            f"which does not divide it: {hint}"
        )


def main():
    # ---------------------------------------- flags
    parser = build_parser(__doc__)
    g = parser.add_argument_group("tensor parallel")
    g.add_argument(
        "--tp_size",
        type=int,
        default=-1,
        help="ranks per TP group (-1: all processes, pure TP; 1: no TP split, FSDP over all processes)",
    )
    g.add_argument(
        "--sequence_parallel",
        action="store_true",
        help="shard LayerNorm/dropout activations along the sequence "
        "(all-gather + reduce-scatter instead of all-reduce)",
    )
    g.add_argument(
        "--loss_parallel",
        action="store_true",
        help="compute the cross-entropy on vocabulary-sharded logits, never gathering them",
    )
    args = parser.parse_args()
    args.output_dir = args.output_dir or "runs/tp"
    check_core_args(args)
    model_config = model_config_from_args(args)

    # ---------------------------------------- Accelerator and layout
    # Accelerate: process group (gloo on CPU, NCCL on GPU), device, mixed precision from the launcher;
    # the scheduler counts optimizer steps, whatever the layout.
    accelerator = make_accelerator(args, sharded="train_tp", step_scheduler_with_optimizer=False)
    layout = Layout.from_degrees(
        accelerator.num_processes, tp=args.tp_size, dp_shard=1 if args.tp_size == -1 else -1
    )  # TP x the rest
    layout.check_model(model_config)  # TP divides the heads, the MLP width and the vocabulary
    global_batch_size = args.batch_size * layout.dp * args.gradient_accumulation_steps

    # ---------------------------------------- data (checked before anything is written)
    data = load_data(args, accelerator, model_config.block_size)
    train_loader = make_train_loader(data.train, args.batch_size, global_batch_size, args.seed)
    check_tp_flags(layout, data.seq_len, data.task, args.sequence_parallel, args.loss_parallel)
    resume_path = check_resume_and_output(accelerator, args, model_config, global_batch_size)
    layout.build_mesh(accelerator.device.type)

    # ---------------------------------------- model
    set_seed(args.seed)  # Accelerate: the same full model on every rank, then split: init independent of the layout
    model = GPT(model_config).to(accelerator.device)
    n_params = count_parameters(model)

    # ---------------------------------------- TP: the strategy
    # A TP group of one rank has nothing to split: the plan would only route every op through
    # DTensor, about 4x DDP's host time per step (docs/benchmarks.md). Like torchtitan, skip it.
    if layout.tp > 1:
        apply_tensor_parallel(model, layout.sub("tp"), args.sequence_parallel, args.loss_parallel)  # TP: split blocks
    if args.compile:
        compile_blocks(model, accelerator)  # after the TP split, before FSDP
    if layout.dp > 1:  # processes beyond the TP group: data parallel over the TP groups (FSDP)
        apply_fsdp(model, [model], layout.fsdp_mesh, accelerator.mixed_precision)

    # ---------------------------------------- optimizer (after splitting: it sees the shards)
    optimizer = make_optimizer(model, args)
    scheduler = make_scheduler(optimizer, args)
    # Accelerate: optimizer/scheduler wrappers (not the model: TP owns it);
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
    log = RunLog(accelerator, args, "train_tp", step, layout.world_size, global_batch_size)
    heads, cols = model_config.n_head, 4 * model_config.n_embd
    megatron_mib = 4 * args.batch_size * data.seq_len * model_config.n_embd / 2**20  # one activation all-reduce, fp32
    on_off = {True: "on", False: "off"}
    tp_line = (
        f"tensor parallel: {layout.tp} ranks per group, {heads // layout.tp} of {heads} heads and {cols // layout.tp} "
        f"of {cols} MLP columns each; sequence parallel {on_off[args.sequence_parallel]}, "
        f"loss parallel {on_off[args.loss_parallel]}"
    )
    megatron_line = (
        f"Megatron's count per step: 4 all-reduces per layer of b*s*d = {megatron_mib:.3f} MiB "
        f"({4 * model_config.n_layer} for {model_config.n_layer} layers); measured below"
    )
    tp_lines = [tp_line, megatron_line]
    if layout.tp == 1:
        fsdp = f" (FSDP over the {layout.dp} ranks)" if layout.dp > 1 else ""
        tp_lines = [f"tensor parallel: 1 rank per group{fsdp}: nothing to split, so the TP plan is not applied"]
    costs = sharded_start_lines(model, layout, n_params, args.optimizer, accelerator)
    log.start(model_config, n_params, data, [*tp_lines, costs], resume_path, layout)
    state_bytes, comm = {}, {}  # measured on the first step
    model.train()
    while step < min(args.max_steps, args.stop_at_step or args.max_steps) and not stream.preempted:
        log.step_start()
        window, global_targets = stream.next_step()
        # the first step's collectives are counted (not under --compile: a dispatch mode stops it)
        with CollectiveCounter(enabled=step == start_step and not args.compile) as counter:
            # TP: every layer's f/g collectives run inside forward and backward
            loss_sum = tp_forward_backward(accelerator, model, window, global_targets, layout.dp, args.loss_parallel)
        # over the shards: the whole model's norm
        grad_norm = clip_grad_norm_(model.parameters(), args.max_grad_norm, layout.group("pp"))
        lr = scheduler.get_last_lr()[0]
        optimizer.step()  # TP: each rank updates its slice of every matrix
        scheduler.step()
        if step == start_step:
            state_bytes, comm = training_state_bytes(model, optimizer), counter.report()
            log.write(first_step_line(state_bytes, comm))
        optimizer.zero_grad(set_to_none=True)
        step += 1
        log.step_end()

        if log.is_log_step(step):
            # the ranks of a TP group hold the same loss sum: one per data-parallel replica counts it
            loss_sum = loss_sum if layout.holds_loss else torch.zeros_like(loss_sum)
            loss = (accelerator.reduce(loss_sum, reduction="sum") / global_targets).item()  # Accelerate: all-reduce
            log.train(step, loss, lr, grad_norm, epoch=stream.epoch)
        if log.is_eval_step(step):
            model.eval()
            result = evaluate_sharded(accelerator, model, data.validation, args.eval_batch_size, layout, data.task)
            model.train()
            log.eval(step, result)
        if log.is_checkpoint_step(step) or stream.preempted:  # preempted: every rank saves
            state = trainer_state(step, stream, args, model_config, global_batch_size, layout.world_size, layout)
            # every rank writes its part (a collective)
            save_checkpoint(accelerator, model, optimizer, scheduler, state, args.output_dir, args.keep_last)
    stream.close()

    # ---------------------------------------- save
    if step == args.max_steps:  # every rank: gathers the shards
        export_model(accelerator, model, model_config, data_source(args), Path(args.output_dir) / "model", layout)
    costs = sharded_summary(accelerator, layout, n_params, args.optimizer, state_bytes, comm)
    log.summary(
        step,
        preempted=stream.preempted,
        **costs,
        megatron_allreduce_mib_each=round(megatron_mib, 4),
        megatron_allreduces_per_step=4 * model_config.n_layer * args.gradient_accumulation_steps,
    )
    accelerator.wait_for_everyone()
    accelerator.end_training()  # Accelerate: closes trackers, destroys the process group


if __name__ == "__main__":
    run_main(main)
