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
    accelerate launch --config_file accelerate_configs/cpu_multi.yaml scripts/train_tp.py
    accelerate launch --config_file accelerate_configs/gpu_multi.yaml scripts/train_tp.py \\
        --sequence_parallel --loss_parallel
    python scripts/train_tp.py                     # one process: nothing to split, the plan is not applied
TP only: the TP group is every process. Data parallel beside TP (dp x tp) is train_hybrid.py's.
The MODEL section holds the plan, {module name: how to split it}: the built-in GPT's, written by
hand; a 🤗 model's is read from its own config (config.base_model_tp_plan, through the style table
of common/hf_tp.py; KV heads fewer than the ranks replicated, as Megatron does).
Lines marked `# Accelerate:` are the library's part; the rest is plain PyTorch.
`# TP:` marks the strategy; its checks are in common/tp_checks.py, its costs in common/tp_costs.py.
"""

import sys
from contextlib import nullcontext
from functools import partial
from pathlib import Path

# scripts run as files: copy common/ beside this file
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.nn as nn
from accelerate.utils import set_seed
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

from common.checkpoint import export_model, load_checkpoint, save_checkpoint, start_point
from common.cli import batch_of_step, build_parser, check_core_args, data_source
from common.contract_check import check_task_contract
from common.costs import count_parameters
from common.cut_check import check_cut, uncut_copy
from common.evaluation import evaluate
from common.launch import make_accelerator, record_peers, run_main
from common.layout import Layout
from common.loader import make_train_loader
from common.metrics import RunMonitor
from common.output_checks import check_resume_and_output, trial_checkpoint
from common.sharded import clip_grad_norm_, shard_loader
from common.sharded_costs import sharded_start_line, sharded_summary
from common.tied import check_tp_keeps_ties
from common.tp_checks import check_plan_forward, check_tp_flags, check_tp_layout, check_tp_plan
from common.tp_costs import tp_start_lines
from common.training import StepFeed, compile_units, make_optimizer, make_scheduler


# ======================================== MODEL: the TP plan, {module name: style} (docs/your-model.md)
def tensor_parallel_plan(model: nn.Module, sequence_parallel: bool, loss_parallel: bool) -> dict:
    """Megatron's split of the built-in GPT, as a parallelize_module plan (for the parts this rank holds).

    Per block: q/k/v column-wise (each rank computes n_head/tp heads), o_proj row-wise; up_proj
    column-wise, down_proj row-wise. One all-reduce after o_proj and one after down_proj in forward
    (Megatron's g), one each at the block's inputs in backward (f). With sequence parallel the norms
    work on a slice of the sequence, and each all-reduce becomes an all-gather before attention/MLP
    plus a reduce-scatter after them."""
    seq = Shard(1)  # the sequence dimension of (batch, seq, hidden)
    between_blocks = seq if sequence_parallel else Replicate()
    plan = {}
    if model.tok_emb is not None:  # vocab/tp rows each; sums reduced
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between_blocks)
        if sequence_parallel:  # positions of this rank's sequence slice, to add to its token slice
            plan["pos_emb"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=seq)
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
                # attention and MLP take their input as one replicated DTensor (all-gathered from
                # the sequence slices under SP): q, k and v share it, so backward reduces its
                # gradient once, not 3 times
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


def model_tp_plan(model: nn.Module, task, layout: Layout, sequence_parallel: bool, loss_parallel: bool) -> dict:
    """This model's plan, after checking that the TP degree divides what the plan splits (heads, MLP
    width, vocabulary): a 🤗 model's, read from its own config, else the built-in GPT's (above).
    A model of your own: return its plan here (docs/your-model.md)."""
    if getattr(task, "hf_config", None) is not None:  # a 🤗 transformers model (HFCausalLMTask)
        from common.hf_tp import hf_tp_plan  # the 🤗 families' plans: imported only for a 🤗 model

        return hf_tp_plan(model, task.units_path, layout, sequence_parallel, loss_parallel)
    from common.tp_checks import check_gpt_plan

    check_gpt_plan(model, task, layout.tp)  # the GPT's: TP divides heads, MLP width, vocabulary
    return tensor_parallel_plan(model, sequence_parallel, loss_parallel)


# ======================================== TP: the strategy
def apply_tensor_parallel(model: nn.Module, tp_mesh, plan: dict) -> None:
    """parallelize_module swaps each weight the plan names for a DTensor shard over `tp_mesh` (a 1-D
    mesh) and adds the f/g collectives as hooks. `plan`: {module name: style}, the MODEL section's
    (model_tp_plan), checked with check_tp_plan first."""
    check_tp_keeps_ties(model, plan)  # a tied weight cut trains untied
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}  # LoRA's base
    if frozen:  # LoRA: each adapter cut to follow its layer (common/lora.py)
        from common.lora import lora_tp_plan

        plan = lora_tp_plan(model, plan)
    parallelize_module(model, tp_mesh, plan)
    for name, p in model.named_parameters():  # SequenceParallel makes its weights anew, all trainable
        p.requires_grad_(name not in frozen)


def tp_forward_backward(
    accelerator, model, task, micro_batches: list, n_global_targets, use_loss_parallel: bool, counts_loss: bool
) -> torch.Tensor:
    """TP's step: every rank of the TP group runs the SAME micro-batches through its shards of each
    layer; the plan's collectives (f and g in the picture above) run inside forward and backward.
    The loss is divided by the target count of the whole global batch, not averaged per micro-batch
    (which weights targets unequally), and not multiplied by a data-parallel size: there is none.
    Under --loss_parallel the cross-entropy runs on the vocabulary shards of the logits. Returns the
    loss sum on the rank that counts it for the group (counts_loss), zero on the others."""
    step_loss_sum = torch.zeros((), device=accelerator.device)
    for mb in micro_batches:
        # TP: under --loss_parallel the cross-entropy runs on the vocabulary shards of the logits
        with accelerator.autocast(), loss_parallel() if use_loss_parallel else nullcontext():
            loss_sum, _ = task.loss_of(model, mb)
            accelerator.backward(loss_sum / n_global_targets)  # Accelerate: backward
        if isinstance(loss_sum, DTensor):  # TP: --loss_parallel's loss, on the vocabulary shards
            loss_sum = loss_sum.detach().full_tensor()
        step_loss_sum += loss_sum.detach()
    # TP: the whole TP group runs the same micro-batches, so holds the same sum: one rank counts it
    return step_loss_sum if counts_loss else torch.zeros_like(step_loss_sum)


def main():
    # ---------------------------------------- flags
    parser = build_parser(__doc__)
    from common.builtin_flags import add_builtin_flags  # the built-in data sets' and models' flags

    add_builtin_flags(parser)  # data and a model of your own: drop these two lines
    g = parser.add_argument_group("tensor parallel")
    size = "ranks per TP group: all processes (-1, or their number); data parallel beside TP is "
    size += "train_hybrid.py's"
    g.add_argument("--tp_size", type=int, default=-1, help=size)
    sp = "shard LayerNorm/dropout activations along the sequence (all-gather + reduce-scatter "
    sp += "instead of all-reduce)"
    g.add_argument("--sequence_parallel", action="store_true", help=sp)
    lp = "compute the cross-entropy on vocabulary-sharded logits, never gathering them"
    g.add_argument("--loss_parallel", action="store_true", help=lp)
    args = parser.parse_args()
    args.output_dir = args.output_dir or "runs/tp"
    check_core_args(args)

    # ---------------------------------------- Accelerator and layout
    # Accelerate: process group (gloo on CPU, NCCL on GPU), device, mixed precision (launcher).
    # cpu=True where CUDA is missing: the N processes then join one gloo group (else each
    # trains alone). The scheduler counts optimizer steps, whatever the layout.
    accelerator = make_accelerator(
        args,
        cpu=args.cpu or not torch.cuda.is_available(),
        sharded=True,  # TP owns the model: refuses a launch that also asks Accelerate to shard it
        step_scheduler_with_optimizer=False,
    )
    record_peers(accelerator)  # guard: peer records
    dp_shard = 1 if args.tp_size == -1 else -1  # TP: a smaller --tp_size: refused below
    layout = Layout.from_degrees(accelerator.num_processes, tp=args.tp_size, dp_shard=dp_shard)
    check_tp_layout(layout)  # TP: TP only; data parallel beside TP is train_hybrid.py's
    dp_size = layout.dp  # TP: 1, every rank of the TP group reads the same batch
    grad_accum, global_batch_size = batch_of_step(args, dp_size)

    # ---------------------------------------- data (checked before anything is written)
    # the built-in data sets (addition, pystdlib, hub, your files) in the model's context and tokens
    from common.data import load_data
    from common.model import context_length, tokenizer_for

    data = load_data(args, accelerator, context_length(args), tokenizer_for(args))
    train_loader = make_train_loader(data.train, args.batch_size, global_batch_size, args.seed)

    # ---------------------------------------- MODEL: the only lines that name the model
    set_seed(args.seed)  # Accelerate: the same full model on every rank, whatever the layout
    # the built-in GPT or a 🤗 causal LM (--model_name_or_path, --model_config), and its Task: a
    # micro-batch's (loss_sum, n_targets), its evaluation and export (docs/your-model.md)
    from common.model import language_model

    model, task = language_model(args, data, on_meta=True)  # TP: a 🤗 model on meta
    on_meta = any(p.is_meta for p in model.parameters())
    model = model if on_meta else model.to(accelerator.device)
    plan = model_tp_plan(model, task, layout, args.sequence_parallel, args.loss_parallel) if layout.tp > 1 else {}
    n_params, model_line = count_parameters(model), task.describe(model)
    check_tp_plan(model, plan, args.sequence_parallel, args.loss_parallel)  # TP: fits the model
    check_tp_flags(layout, task, args.sequence_parallel, args.loss_parallel)  # and the layout, data
    resume_path, facts = start_point(accelerator, args, model, task, global_batch_size, layout)
    check_resume_and_output(accelerator, args, resume_path, facts)  # guard: output lock
    reference = uncut_copy(model, task, args.skip_cut_check)  # guard: cut check
    units = task.units(model)  # before the cut: --compile compiles each unit after it

    # ---------------------------------------- TP: the strategy
    # A TP group of one rank has nothing to split: the plan would only route every op through
    # DTensor, about 4x DDP's host time per step (docs/benchmarks.md). Like torchtitan, skip it.
    layout.build_mesh(accelerator.device.type)
    if layout.tp > 1:
        apply_tensor_parallel(model, layout.sub("tp"), plan)  # TP: its weights become shards
    if on_meta:  # TP: each rank makes only its shards (read or initialised)
        model.to_empty(device=accelerator.device)
        task.materialize(model)
    if args.compile:
        compile_units(units, accelerator)  # after the TP split

    # ---------------------------------------- optimizer
    optimizer = make_optimizer(model, args)  # TP: after the cut, it holds each rank's shards
    scheduler = make_scheduler(optimizer, args)
    train_sampler = train_loader.sampler
    # Accelerate: optimizer and scheduler wrappers (not the model: TP owns it)
    optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
    train_loader = shard_loader(train_loader, accelerator, layout)
    check_plan_forward(model, plan, task, data.validation, accelerator.device)  # TP: the cut model runs
    lp = loss_parallel() if args.loss_parallel else None  # TP: the loss on vocabulary shards
    check_task_contract(task, model, data.validation, accelerator.device, lp)  # guard: contract
    probe_step = partial(tp_forward_backward, accelerator, model, task)  # TP: the step, on a probe
    probe_step.keywords.update(use_loss_parallel=args.loss_parallel, counts_loss=layout.holds_loss)
    check_cut(accelerator, model, probe_step, reference, task, data.validation, grad_accum, layout)  # guard: cut check
    progress = load_checkpoint(accelerator, resume_path, model, optimizer, scheduler)  # or step 0
    trial_checkpoint(accelerator, args, facts, model, optimizer, scheduler)  # guard: trial
    feed = StepFeed(
        accelerator,
        train_loader,
        train_sampler,
        global_batch_size,
        grad_accum,
        progress,
        task.count_targets,
        dp_group=layout.group("dp"),
    )
    feed.seed_dropout(args.seed, layout)  # dropout: each dp rank its own masks
    monitor = RunMonitor(accelerator, args, "train_tp", feed, layout.world_size, global_batch_size)
    tp_lines, megatron = tp_start_lines(model, plan, layout, args, task.tokens_per_sample or 1, on_meta)
    costs = sharded_start_line(model, layout, n_params, args.optimizer, accelerator)
    monitor.start(task, model_line, n_params, data, [*tp_lines, costs], resume_path, layout)

    # ---------------------------------------- the training loop
    step, last_step = progress["step"], min(args.max_steps, args.stop_at_step or args.max_steps)
    model.train()
    while step < last_step and not feed.preempted:
        with monitor.timed_step():  # training time (not the records, evaluations, checkpoints)
            micro_batches, n_global_targets = feed.next_step()
            # TP: the TP group runs the same micro-batches; each layer's f/g collectives inside
            with monitor.collectives():
                loss_sum = tp_forward_backward(
                    accelerator, model, task, micro_batches, n_global_targets, args.loss_parallel, layout.holds_loss
                )
            grad_norm = clip_grad_norm_(model.parameters(), args.max_grad_norm)  # TP: all shards
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

        if monitor.due(step, "train"):
            # Accelerate: the loss sums of all ranks (an all-reduce)
            loss = (accelerator.reduce(loss_sum, reduction="sum") / n_global_targets).item()
            monitor.train(step, loss, lr, grad_norm)
        if monitor.due(step, "eval"):  # TP: each sample counted once
            scores = evaluate(accelerator, model, task, data.validation, args.eval_batch_size, layout)
            monitor.eval(step, scores)
        if monitor.due(step, "checkpoint") or feed.preempted:  # every rank writes its part
            save_checkpoint(accelerator, args, step, feed, model, optimizer, scheduler, facts)
    feed.close()

    # ---------------------------------------- save
    if step == args.max_steps:  # every rank gathers what it holds; the main process writes
        export_model(accelerator, model, task, data_source(args), Path(args.output_dir) / "model", layout)
    costs = sharded_summary(accelerator, layout, n_params, args.optimizer, model, optimizer)
    monitor.summary(step, preempted=feed.preempted, **costs, **megatron)  # TP: + Megatron's count
    accelerator.wait_for_everyone()
    accelerator.end_training()  # Accelerate: closes trackers and destroys the process group


if __name__ == "__main__":
    run_main(main)
