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

Run it:
    accelerate launch --config_file accelerate_configs/cpu_multi.yaml scripts/train_ddp.py   # 2 CPU processes
    accelerate launch --config_file accelerate_configs/gpu_multi.yaml scripts/train_ddp.py   # all GPUs of a node
    python scripts/train_ddp.py                                                             # one process
Lines marked `# Accelerate:` are the library's part; the rest is plain PyTorch.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts run as files: copy common/ beside this file

import torch
from accelerate.utils import GradientAccumulationPlugin, set_seed

from common.checkpoint import check_resume_and_output, export_model, load_checkpoint, save_checkpoint
from common.data import data_source, load_data, make_train_loader
from common.launch import build_parser, check_core_args, make_accelerator, run_main
from common.metrics import RunLog, evaluate, peak_memory_mb, ring_allreduce_bytes
from common.model import context_length, count_parameters, language_model
from common.task import check_loss_is_a_sum
from common.training import TrainStream, compile_units, make_optimizer, make_scheduler


def main():
    # ---------------------------------------- flags
    args = build_parser(__doc__).parse_args()
    args.output_dir = args.output_dir or "runs/ddp"
    check_core_args(args)
    grad_accum = args.gradient_accumulation_steps

    # ---------------------------------------- Accelerator
    # Accelerate: process group (gloo on CPU, NCCL on GPU), device, mixed precision from the launcher.
    # On a machine without CUDA, make_accelerator passes Accelerator(cpu=True): without it, the N processes
    # of a torchrun-style launch would each train alone (docs/troubleshooting.md).
    # The scheduler counts optimizer steps (step_scheduler_with_optimizer=False): Accelerate's default
    # would step it once per process, and the LR would then depend on the number of processes.
    accelerator = make_accelerator(
        args,
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=grad_accum, sync_with_dataloader=False, adjust_scheduler=False
        ),
        step_scheduler_with_optimizer=False,
    )
    dp_size = accelerator.num_processes  # DDP: every process is a data-parallel replica
    global_batch_size = args.batch_size * dp_size * grad_accum

    # ---------------------------------------- data (checked before anything is written)
    data = load_data(args, accelerator, context_length(args))
    train_loader = make_train_loader(data.train, args.batch_size, global_batch_size, args.seed)

    # ---------------------------------------- MODEL: the only lines that name the model (docs/your-model.md)
    set_seed(args.seed)  # Accelerate: seeds python, numpy and torch; same value on every rank
    # the built-in GPT, or a 🤗 transformers causal LM (--model_name_or_path, --model_config), and its Task:
    # the loss of a micro-batch as (loss_sum, n_targets), the targets it counts, its evaluation and export
    model, task = language_model(args, data)
    model = model.to(accelerator.device)  # the same full model on every rank: the replicas start equal
    n_params, model_line = count_parameters(model), task.describe(model)
    resume_path, facts = check_resume_and_output(accelerator, args, model, task, global_batch_size)
    if args.compile:
        compile_units(task.units(model), accelerator)  # each repeated unit; DDP's all-reduce hooks stay outside

    # ---------------------------------------- optimizer
    optimizer = make_optimizer(model, args)
    scheduler = make_scheduler(optimizer, args)
    train_sampler = train_loader.sampler

    # ---------------------------------------- DDP: the strategy
    # Accelerate: wraps the model in DistributedDataParallel (gradient all-reduce in backward),
    # moves everything to the device, and shards the loader: rank r takes every dp_size-th micro-batch.
    model, optimizer, train_loader, scheduler = accelerator.prepare(model, optimizer, train_loader, scheduler)

    check_loss_is_a_sum(task, model, data.validation, accelerator.device)  # a mean would train silently wrong
    progress = load_checkpoint(accelerator, resume_path, model, optimizer, scheduler)  # step 0 without a checkpoint
    stream = TrainStream(
        accelerator, train_loader, train_sampler, global_batch_size, grad_accum, progress, task.count_targets
    )
    log = RunLog(accelerator, args, "train_ddp", progress["step"], dp_size, global_batch_size)
    allreduce_mib = ring_allreduce_bytes(4 * n_params, dp_size) / 2**20  # fp32 gradients
    ddp_line = f"gradient all-reduce per step and rank (ring): 2(N-1)/N x {4 * n_params / 2**20:.1f} MiB"
    log.start(task, model_line, n_params, data, [f"{ddp_line} = {allreduce_mib:.1f} MiB"], resume_path)

    # ---------------------------------------- the training loop
    step, last_step = progress["step"], min(args.max_steps, args.stop_at_step or args.max_steps)
    model.train()
    while step < last_step and not stream.preempted:
        log.step_start()
        # This rank's micro-batches, and the target count of the whole global batch (all micro-batches,
        # all ranks): the loss is divided by it, not averaged per micro-batch (which weights targets unequally).
        window, global_targets = stream.next_step()
        loss_sum = torch.zeros((), device=accelerator.device)
        for mb in window:
            with accelerator.accumulate(model):  # Accelerate: skips DDP's all-reduce until the last micro-batch
                mb_loss_sum, _ = task.loss_of(model, mb)
                # DDP averages gradients over dp_size ranks and accelerator.backward divides by grad_accum:
                # scale back, so the gradient is that of (global loss sum / global targets). DDP: all-reduce.
                accelerator.backward(mb_loss_sum * dp_size * grad_accum / global_targets)  # Accelerate: backward
                loss_sum += mb_loss_sum.detach()
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm or float("inf"))
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        log.step_end()

        if log.due(step, "train"):
            loss = (accelerator.reduce(loss_sum, reduction="sum") / global_targets).item()  # Accelerate: all-reduce
            log.train(step, loss, lr, grad_norm, epoch=stream.epoch)
        if log.due(step, "eval"):
            log.eval(step, evaluate(accelerator, model, task, data.validation, args.eval_batch_size))
        if log.due(step, "checkpoint") or stream.preempted:  # every rank writes its part (a collective)
            save_checkpoint(accelerator, args, step, stream, model, optimizer, scheduler, facts)
    stream.close()

    # ---------------------------------------- save
    if step == args.max_steps:  # every rank; main writes
        export_model(accelerator, model, task, data_source(args), Path(args.output_dir) / "model")
    peak_mb = accelerator.gather(
        torch.tensor([peak_memory_mb(accelerator.device)], device=accelerator.device)
    )  # Accelerate: all-gather
    log.summary(
        step,
        preempted=stream.preempted,
        n_params=n_params,
        peak_memory_mb_max_rank=round(peak_mb.max().item(), 1),
        peak_memory_mb_all_ranks=round(peak_mb.sum().item(), 1),
        gradient_allreduce_mib_per_step_per_rank=round(allreduce_mib, 3),
    )
    # Accelerate: closes trackers and destroys the process group. Free the DDP wrapper first, while
    # every peer is still there: its destructor tears down a gloo group that can wait on a peer.
    del model, optimizer, scheduler, train_loader, stream
    accelerator.free_memory()
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    run_main(main)
