#!/usr/bin/env python
"""Fully sharded data parallel (FSDP2, ZeRO-3 style) with PyTorch's `fully_shard`, under 🤗
Accelerate.

Like DDP, every rank trains on its own slice of each global batch. Unlike DDP, no rank holds
the whole model: each parameter, its gradient and its optimizer state are cut into N shards,
one per rank. A block's full weights exist only while that block computes:

    for each block, forward:   all-gather the block's shards -> compute -> free the gathered copy
    for each block, backward:  all-gather again -> compute grads -> reduce-scatter them -> free
    optimizer step:            each rank updates only its own shard (Adam state for 1/N)

    memory per rank (fp32 Adam):  DDP 16 bytes x params   FSDP 16/N bytes x params (+ 1 block)
    communication per step:       DDP all-reduce 2x       FSDP all-gather x2 + reduce-scatter = 3x
    gradient accumulation:        a reduce-scatter per micro-batch, gradients sharded
                                  (--unsharded_accumulation: whole gradients through the window,
                                  one reduce-scatter at its last micro-batch)

Run it:
    accelerate launch --config_file accelerate_configs/cpu_multi.yaml scripts/train_fsdp.py
    accelerate launch --config_file accelerate_configs/gpu_multi.yaml scripts/train_fsdp.py
    ... scripts/train_fsdp.py --dp_replicate 2     # HSDP: shard inside groups, replicate across
    python scripts/train_fsdp.py                   # one process: nothing to shard, none applied
(on GPUs, `--mixed_precision bf16` after `accelerate launch`: bf16 compute, fp32 reductions)
Lines marked `# FSDP:` are the strategy; `# Accelerate:` the library's part. Accelerate's own
FSDP plugin is not used (on CPU it is silently ignored): this file applies FSDP2 itself.
"""

import argparse
import sys
from functools import partial
from pathlib import Path

# scripts run as files: copy common/ beside this file
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from accelerate.utils import set_seed
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from common.batchnorm import batchnorm_line
from common.checkpoint import export_model, load_checkpoint, save_checkpoint, start_point
from common.cli import batch_of_step, build_parser, check_core_args, data_source
from common.contract_check import check_task_contract
from common.costs import count_parameters
from common.cut_check import check_cut, uncut_copy
from common.errors import UsageError
from common.evaluation import evaluate
from common.launch import make_accelerator, record_peers, run_main
from common.layout import Layout
from common.loader import make_train_loader
from common.metrics import RunMonitor
from common.output_checks import check_resume_and_output, trial_checkpoint
from common.sharded import clip_grad_norm_, shard_loader
from common.sharded_costs import sharded_start_line, sharded_summary
from common.training import StepFeed, compile_units, make_optimizer, make_scheduler


# ======================================== FSDP: the strategy
def apply_activation_checkpointing(units) -> None:
    """Recompute each unit's activations in backward (the composable `checkpoint` keeps parameter
    names)."""
    from torch.distributed._composable import checkpoint

    for unit in units.children():
        checkpoint(unit)


def apply_fsdp(units, roots: list, mesh, mixed_precision="no", reshard_after_forward=True, cpu_offload=False) -> None:
    """One FSDP unit per repeated unit (a block, a decoder layer), then each root (the whole model,
    or each pipeline stage) holding what is left: embeddings, final norm, head. A unit is
    all-gathered before its forward and again before its backward, its gradients reduce-scattered
    after its backward: one unit is unsharded at a time. A root stays gathered for the step (its
    head runs last in forward, first in backward: torch's default for a root). A 2-D mesh makes it
    HSDP: replicate over dim 0, shard over dim 1."""
    # bf16 compute, fp32 gradient reduction and fp32 master weights (--mixed_precision)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kwargs = {
        "mesh": mesh,
        "mp_policy": bf16 if mixed_precision == "bf16" else MixedPrecisionPolicy(),
        "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    }
    # a ModuleDict's or a ModuleList's; a pipeline's placeholders hold nothing
    for unit in units.children():
        if any(True for _ in unit.parameters()):
            fully_shard(unit, reshard_after_forward=reshard_after_forward, **kwargs)
    for root in roots:
        fully_shard(root, reshard_after_forward=False, **kwargs)


def fsdp_forward_backward(
    accelerator, model, task, micro_batches: list, n_global_targets, dp_size: int, unsharded_accumulation=False
) -> torch.Tensor:
    """FSDP's step: forward and backward of this rank's micro-batches, on its own slice of the global
    batch; each unit all-gathers its whole weights for its forward and backward, and reduce-scatters
    its gradients after, so a rank keeps 1/N of the parameters, gradients and optimizer state.
    Returns the loss sum. The loss is divided by the target count of the whole global batch (all
    micro-batches, all ranks), not averaged per micro-batch (which weights targets unequally), and
    multiplied by dp_size because each reduce-scatter averages over the ranks.

    Gradient accumulation, by default as torchtitan: every micro-batch's backward reduce-scatters
    each unit's gradient and frees the unsharded one, so a rank accumulates only its 1/N shard. With
    `unsharded_accumulation` (FSDP's no_sync), each unit keeps its whole unsharded gradient until
    the window's last micro-batch and reduce-scatters once: 1/m of the traffic, the whole model's
    gradients."""
    step_loss_sum = torch.zeros((), device=accelerator.device)
    for i, mb in enumerate(micro_batches):
        # FSDP: reduce-scatter at the last only
        if unsharded_accumulation and isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(i == len(micro_batches) - 1)
        with accelerator.autocast():  # Accelerate: autocast
            loss_sum, _ = task.loss_of(model, mb)
            # FSDP averages the gradients over the dp ranks (in each reduce-scatter):
            # scale back, so the gradient is that of (global loss sum / global targets)
            accelerator.backward(loss_sum * dp_size / n_global_targets)  # Accelerate: backward
        step_loss_sum += loss_sum.detach()
    return step_loss_sum


SYNC_BATCHNORM_HELP = (
    "BatchNorm over the global micro-batch (all ranks): the same run as one process (without "
    "it, each rank normalises its own micro-batch; DDP keeps rank 0's running statistics)"
)


def main():
    # ---------------------------------------- flags
    parser = build_parser(__doc__)
    from common.builtin_flags import add_builtin_flags  # the built-in data sets' and models' flags

    add_builtin_flags(parser, moe=True)  # data and a model of your own: drop these two lines
    g = parser.add_argument_group("fully sharded data parallel")
    g.add_argument("--dp_replicate", type=int, default=1, help="HSDP: replicate over N groups, shard inside each")
    reshard = "ZeRO-3: free each unit's gathered weights after forward "
    reshard += "(--no-reshard_after_forward: ZeRO-2 like)"
    g.add_argument("--reshard_after_forward", action=argparse.BooleanOptionalAction, default=True, help=reshard)
    g.add_argument("--cpu_offload", action="store_true", help="keep shards, gradients, optimizer state in CPU memory")
    g.add_argument("--activation_checkpointing", action="store_true", help="recompute each unit's activations")
    whole = "keep whole-model unsharded gradients through the accumulation window and "
    whole += "reduce-scatter once at its last micro-batch: less communication, more memory "
    whole += "(default: reduce-scatter every micro-batch)"
    g.add_argument("--unsharded_accumulation", action="store_true", help=whole)
    g.add_argument("--sync_batchnorm", action="store_true", help=SYNC_BATCHNORM_HELP)
    args = parser.parse_args()
    args.output_dir = args.output_dir or "runs/fsdp"
    check_core_args(args)

    # ---------------------------------------- Accelerator and layout
    # Accelerate: process group (gloo on CPU, NCCL on GPU), device, mixed precision (launcher).
    # cpu=True where CUDA is missing: the N processes then join one gloo group (else each
    # trains alone). The scheduler counts optimizer steps, whatever the layout.
    accelerator = make_accelerator(
        args,
        cpu=args.cpu or not torch.cuda.is_available(),
        sharded=True,  # refuses a launch that also asks Accelerate to shard
        step_scheduler_with_optimizer=False,
    )
    record_peers(accelerator)  # guard: peer records
    layout = Layout.from_degrees(accelerator.num_processes, dp_replicate=args.dp_replicate, dp_shard=-1)
    dp_size = layout.dp  # FSDP: every rank is a data-parallel rank, holding 1/dp_shard of the model
    # batch_size x dp_size x accumulation
    grad_accum, global_batch_size = batch_of_step(args, dp_size)
    if args.cpu_offload and accelerator.device.type == "cpu":  # FSDP: nothing to offload to
        raise UsageError("--cpu_offload moves state to CPU memory, but this run is already on the CPU: drop it")

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

    model, task = language_model(args, data, on_meta=True)  # FSDP: a 🤗 model on meta
    on_meta = any(p.is_meta for p in model.parameters())  # FSDP: it waits there for its shards
    model = model if on_meta else model.to(accelerator.device)  # FSDP: a model with weights moves
    if getattr(args, "n_experts", 0):  # the built-in MoE: token counts move the expert bias
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        from common.moe import update_expert_bias

        register_optimizer_step_pre_hook(lambda *_, moe_model=model: update_expert_bias(moe_model))
    # the repeated units: one FSDP unit each, activation checkpointing, --compile
    units = task.units(model)
    n_params, model_line = count_parameters(model), task.describe(model)
    resume_path, facts = start_point(accelerator, args, model, task, global_batch_size, layout)
    check_resume_and_output(accelerator, args, resume_path, facts)  # guard: output lock
    reference = uncut_copy(model, task, args.skip_cut_check)  # guard: cut check
    layout.build_mesh(accelerator.device.type)

    # ---------------------------------------- FSDP: the strategy
    if args.activation_checkpointing:
        # FSDP: less activation memory, one more forward per unit
        apply_activation_checkpointing(units)
    if args.compile:
        compile_units(units, accelerator)  # after activation checkpointing, before fully_shard
    # FSDP: BatchNorm normalises over the global micro-batch
    if args.sync_batchnorm and dp_size > 1:
        from common.sync_batchnorm import sync_batchnorm  # imported only by a run that asks for it

        sync_batchnorm(model, accelerator.device, layout.group("dp"))
    # one rank has nothing to shard (torchtitan's rule: docs/fsdp.md)
    shard = dp_size > 1 or args.cpu_offload
    if shard:  # FSDP: shard every unit, then the root
        mesh = layout.fsdp_mesh or layout.sub("dp_shard")
        apply_fsdp(units, [model], mesh, accelerator.mixed_precision, args.reshard_after_forward, args.cpu_offload)
    if on_meta:  # FSDP: each rank makes only its shards (read, or initialised, in slices)
        model.to_empty(device="cpu" if args.cpu_offload else accelerator.device)
        task.materialize(model)

    # ---------------------------------------- optimizer (after sharding: it sees the shards)
    optimizer = make_optimizer(model, args)
    scheduler = make_scheduler(optimizer, args)
    # Accelerate: optimizer/scheduler wrappers (not the model: FSDP owns it);
    # the loader sharded over the dp ranks
    optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
    train_sampler = train_loader.sampler
    train_loader = shard_loader(train_loader, accelerator, layout)
    check_task_contract(task, model, data.validation, accelerator.device)  # guard: contract
    unsharded = args.unsharded_accumulation and shard  # FSDP: whole gradients in the window
    probe_step = partial(fsdp_forward_backward, accelerator, model, task, dp_size=dp_size)
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
    feed.seed_dropout(args.seed, layout)  # dropout: each dp rank its own masks, a resume the same
    monitor = RunMonitor(accelerator, args, "train_fsdp", feed, layout.world_size, global_batch_size)
    fsdp_line = f"FSDP over {layout.dp_replicate} x {layout.dp_shard} ranks (replicas x shards)"
    fsdp_line += "" if len(units) else "; the Task names no units: the whole model is one FSDP unit"
    fsdp_line = fsdp_line if shard else "FSDP over 1 rank: nothing to shard, so fully_shard is not applied"
    fsdp_line += "; each rank made only its shards of the weights (built on meta)" if on_meta and shard else ""  # FSDP:
    # FSDP: the costs count the gradients the accumulation window holds
    window = {"grad_accum": grad_accum, "unsharded_accumulation": unsharded}
    costs = sharded_start_line(model, layout, n_params, args.optimizer, accelerator, **window)
    bn_line = batchnorm_line(model, dp_size, args.sync_batchnorm)  # what differs from 1 process
    monitor.start(task, model_line, n_params, data, [fsdp_line, costs, bn_line], resume_path, layout)

    # ---------------------------------------- the training loop
    step, last_step = progress["step"], min(args.max_steps, args.stop_at_step or args.max_steps)
    model.train()
    while step < last_step and not feed.preempted:
        with monitor.timed_step():  # training time (not the records, evaluations, checkpoints)
            micro_batches, n_global_targets = feed.next_step()
            # FSDP: per unit all-gather, compute; backward reduce-scatters
            with monitor.collectives():
                # FSDP: a reduce-scatter per micro-batch, or per step (unsharded)
                loss_sum = fsdp_forward_backward(
                    accelerator, model, task, micro_batches, n_global_targets, dp_size, unsharded
                )  # FSDP: the step's loss sum
            # FSDP: the shards' norm, every rank
            grad_norm = clip_grad_norm_(model.parameters(), args.max_grad_norm)
            lr = scheduler.get_last_lr()[0]
            optimizer.step()  # FSDP: each rank updates its own shard
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

        if monitor.due(step, "train"):
            # Accelerate: the loss sums of all ranks (an all-reduce)
            loss = (accelerator.reduce(loss_sum, reduction="sum") / n_global_targets).item()
            monitor.train(step, loss, lr, grad_norm)
        if monitor.due(step, "eval"):
            scores = evaluate(accelerator, model, task, data.validation, args.eval_batch_size, layout)
            monitor.eval(step, scores)
        if monitor.due(step, "checkpoint") or feed.preempted:  # every rank writes its part
            save_checkpoint(accelerator, args, step, feed, model, optimizer, scheduler, facts)
    feed.close()

    # ---------------------------------------- save
    if step == args.max_steps:  # every rank gathers what it holds; the main process writes
        export_model(accelerator, model, task, data_source(args), Path(args.output_dir) / "model", layout)
    # FSDP: with the gradients the window holds
    costs = sharded_summary(accelerator, layout, n_params, args.optimizer, model, optimizer, **window)
    monitor.summary(step, preempted=feed.preempted, **costs)
    accelerator.wait_for_everyone()
    accelerator.end_training()  # Accelerate: closes trackers and destroys the process group


if __name__ == "__main__":
    run_main(main)
