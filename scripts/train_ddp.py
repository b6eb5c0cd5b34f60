#!/usr/bin/env python
r"""Data-parallel training (DDP) with 🤗 Accelerate.

Every rank holds the whole model and trains on its own slice of each global batch; after
backward the gradients are averaged over the ranks (all-reduce), so every rank takes the
same optimizer step and the replicas never drift apart:

    global batch of step t:  [ mb 0 | mb 1 | ... | mb N-1 ]
                                |      |             |
    rank:                       0      1    ...     N-1     forward + backward on its own mb
                                \______ all-reduce(grad) ___/
                                  identical optimizer step everywhere

Run it on 2 CPU processes, on all GPUs of a node, or as one process:
    accelerate launch --config_file accelerate_configs/cpu_multi.yaml scripts/train_ddp.py
    accelerate launch --config_file accelerate_configs/gpu_multi.yaml scripts/train_ddp.py
    python scripts/train_ddp.py
Lines marked `# Accelerate:` are the library's part; the rest is plain PyTorch.
"""

import sys
from functools import partial
from pathlib import Path

# scripts run as files: copy common/ beside this file
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from accelerate.utils import GradientAccumulationPlugin, get_int_from_env, set_seed

from common.batchnorm import batchnorm_line
from common.checkpoint import export_model, load_checkpoint, save_checkpoint, start_point
from common.cli import batch_of_step, build_parser, check_core_args, data_source
from common.contract_check import check_task_contract
from common.costs import count_parameters, replicated_summary, ring_allreduce_bytes
from common.cut_check import check_cut, uncut_copy
from common.evaluation import evaluate
from common.launch import WORLD_SIZE_VARS, make_accelerator, record_peers, run_main
from common.loader import make_train_loader
from common.metrics import RunMonitor
from common.output_checks import check_resume_and_output, trial_checkpoint
from common.training import StepFeed, compile_units, make_optimizer, make_scheduler, restride_buffers


# ======================================== DDP: the strategy
def ddp_forward_backward(accelerator, model, task, micro_batches, n_global_targets, dp_size):
    """Forward and backward of this rank's micro-batches; returns their loss sum. The loss is
    normalised by the target count of the whole global batch (all micro-batches, all ranks), not
    averaged per micro-batch (which weights targets unequally when their counts differ)."""
    step_loss_sum = torch.zeros((), device=accelerator.device)
    for mb in micro_batches:
        with accelerator.accumulate(model):  # Accelerate: no all-reduce until the last one
            loss_sum, _ = task.loss_of(model, mb)
            # DDP averages the gradients over the ranks, backward divides by the accumulation
            # steps: scale back, so the gradient is that of (global loss sum / global targets)
            accelerator.backward(loss_sum * dp_size * len(micro_batches) / n_global_targets)
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
    g = parser.add_argument_group("data parallel")
    g.add_argument("--sync_batchnorm", action="store_true", help=SYNC_BATCHNORM_HELP)
    args = parser.parse_args()
    args.output_dir = args.output_dir or "runs/ddp"
    check_core_args(args)
    # the accumulation follows the processes launched (an elastic run keeps its global batch)
    grad_accum, global_batch_size = batch_of_step(args, get_int_from_env(WORLD_SIZE_VARS, 1))

    # ---------------------------------------- Accelerator and layout
    # Accelerate: process group (gloo on CPU, NCCL on GPU), device, mixed precision (launcher).
    # cpu=True where CUDA is missing: the N processes then join one gloo group (else each
    # trains alone). The scheduler counts optimizer steps, whatever the layout.
    # DDP: accumulate() skips the all-reduce until the last micro-batch of a step (our windows)
    accumulation = GradientAccumulationPlugin(num_steps=grad_accum, sync_with_dataloader=False, adjust_scheduler=False)
    accelerator = make_accelerator(
        args,
        cpu=args.cpu or not torch.cuda.is_available(),
        gradient_accumulation_plugin=accumulation,  # DDP: one all-reduce per step
        step_scheduler_with_optimizer=False,
    )
    record_peers(accelerator)  # guard: peer records
    dp_size = accelerator.num_processes  # DDP: every process is a replica of the whole model

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

    model, task = language_model(args, data)
    model = model.to(accelerator.device)
    if getattr(args, "n_experts", 0):  # the built-in MoE: token counts move the expert bias
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        from common.moe import update_expert_bias

        register_optimizer_step_pre_hook(lambda *_, moe_model=model: update_expert_bias(moe_model))
    n_params, model_line = count_parameters(model), task.describe(model)
    resume_path, facts = start_point(accelerator, args, model, task, global_batch_size)
    check_resume_and_output(accelerator, args, resume_path, facts)  # guard: output lock
    reference = uncut_copy(model, task, args.skip_cut_check)  # guard: cut check
    if args.compile:
        compile_units(task.units(model), accelerator)  # each unit, before DDP wraps the model

    # ---------------------------------------- optimizer
    optimizer = make_optimizer(model, args, replicas=dp_size)  # DDP: replicas step alike (Muon deals matrices)
    scheduler = make_scheduler(optimizer, args)
    train_sampler = train_loader.sampler

    # ---------------------------------------- DDP: the strategy
    # Accelerate: wraps the model in DistributedDataParallel (gradient all-reduce in backward),
    # moves everything to the device, and shards the loader: rank r takes every dp_size-th
    # micro-batch. DDP broadcasts rank 0's buffers (BatchNorm's statistics) before each forward.
    if args.sync_batchnorm and dp_size > 1:  # DDP: BatchNorm normalises over the global micro-batch
        from common.sync_batchnorm import sync_batchnorm  # imported only by a run that asks for it

        sync_batchnorm(model, accelerator.device)
    restride_buffers(model)  # DDP: its broadcast of the buffers refuses a transposed one
    model, optimizer, train_loader, scheduler = accelerator.prepare(model, optimizer, train_loader, scheduler)
    check_task_contract(task, model, data.validation, accelerator.device)  # guard: contract
    probe_step = partial(ddp_forward_backward, accelerator, model, task, dp_size=dp_size)
    check_cut(accelerator, model, probe_step, reference, task, data.validation, grad_accum)  # guard: cut check
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
    )
    feed.seed_dropout(args.seed)  # dropout: each rank its own masks, a resume the same ones
    monitor = RunMonitor(accelerator, args, "train_ddp", feed, dp_size, global_batch_size)
    n_grads = sum(p.numel() for p in model.parameters() if p.requires_grad)  # LoRA: the adapters'
    allreduce_mib = ring_allreduce_bytes(4 * n_grads, dp_size) / 2**20  # fp32 gradients
    ddp_line = f"gradient all-reduce per step and rank (ring): 2(N-1)/N x {4 * n_grads / 2**20:.1f} MiB"
    bn_line = batchnorm_line(model, dp_size, args.sync_batchnorm)  # what differs from 1 process
    lines = [f"{ddp_line} = {allreduce_mib:.1f} MiB", bn_line]
    monitor.start(task, model_line, n_params, data, lines, resume_path)

    # ---------------------------------------- the training loop
    step, last_step = progress["step"], min(args.max_steps, args.stop_at_step or args.max_steps)
    model.train()
    while step < last_step and not feed.preempted:
        with monitor.timed_step():  # training time (not the records, evaluations, checkpoints)
            micro_batches, n_global_targets = feed.next_step()
            # DDP: forward and backward of each micro-batch; the all-reduce runs in the last one
            loss_sum = ddp_forward_backward(accelerator, model, task, micro_batches, n_global_targets, dp_size)
            # DDP: Accelerate's clipping unscales fp16 gradients first (0: the norm measured only)
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm or float("inf"))
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

        if monitor.due(step, "train"):
            # Accelerate: the loss sums of all ranks (an all-reduce)
            loss = (accelerator.reduce(loss_sum, reduction="sum") / n_global_targets).item()
            monitor.train(step, loss, lr, grad_norm)
        if monitor.due(step, "eval"):
            scores = evaluate(accelerator, model, task, data.validation, args.eval_batch_size)
            monitor.eval(step, scores)
        if monitor.due(step, "checkpoint") or feed.preempted:  # every rank writes its part
            save_checkpoint(accelerator, args, step, feed, model, optimizer, scheduler, facts)
    feed.close()

    # ---------------------------------------- save
    if step == args.max_steps:  # every rank gathers what it holds; the main process writes
        export_model(accelerator, model, task, data_source(args), Path(args.output_dir) / "model")
    costs = replicated_summary(accelerator, n_params, allreduce_mib)
    monitor.summary(step, preempted=feed.preempted, **costs)
    del model, optimizer, scheduler, train_loader, feed  # free DDP's wrapper while the peers live
    accelerator.free_memory()
    accelerator.wait_for_everyone()
    accelerator.end_training()  # Accelerate: closes trackers and destroys the process group


if __name__ == "__main__":
    run_main(main)
