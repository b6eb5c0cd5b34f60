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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts run as files: make `common` importable

import torch
from accelerate.utils import GradientAccumulationPlugin, set_seed

from common.checkpoint import check_resume_and_output, export_model, load_checkpoint, save_checkpoint
from common.data import data_source, load_data, make_eval_loader, make_train_loader
from common.launch import build_parser, check_core_args, make_accelerator, run_main
from common.metrics import RunLog, evaluate, peak_memory_mb, ring_allreduce_bytes
from common.model import GPT, count_parameters, cross_entropy_sum
from common.training import (
    TrainStream,
    compile_blocks,
    make_optimizer,
    make_scheduler,
    model_config_from_args,
    trainer_state,
)


def main():
    # ---------------------------------------- flags
    args = build_parser(__doc__).parse_args()
    args.output_dir = args.output_dir or "runs/ddp"
    check_core_args(args)
    model_config = model_config_from_args(args)
    grad_accum = args.gradient_accumulation_steps

    # ---------------------------------------- Accelerator
    # Accelerate: process group (gloo on CPU, NCCL on GPU), device, mixed precision from the launcher.
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
    data = load_data(args, accelerator, model_config.block_size)
    train_loader = make_train_loader(data.train, args.batch_size, global_batch_size, args.seed)
    eval_loader = make_eval_loader(data.validation, args.eval_batch_size)
    resume_path = check_resume_and_output(accelerator, args, model_config, global_batch_size)

    # ---------------------------------------- model
    set_seed(args.seed)  # Accelerate: seeds python, numpy and torch; same value on every rank
    model = GPT(model_config).to(accelerator.device)  # the same full model on every rank: the replicas start equal
    n_params = count_parameters(model)
    if args.compile:
        compile_blocks(model, accelerator)  # each block; DDP's all-reduce hooks stay outside

    # ---------------------------------------- optimizer
    optimizer = make_optimizer(model, args)
    scheduler = make_scheduler(optimizer, args)
    train_sampler = train_loader.sampler

    # ---------------------------------------- DDP: the strategy
    # Accelerate: wraps the model in DistributedDataParallel (gradient all-reduce in backward),
    # moves everything to the device, and shards each loader: rank r takes every dp_size-th micro-batch.
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler
    )

    progress = load_checkpoint(accelerator, resume_path, model, optimizer, scheduler)  # step 0 without a checkpoint
    stream = TrainStream(accelerator, train_loader, train_sampler, global_batch_size, grad_accum, progress)

    # ---------------------------------------- the training loop
    step = progress["step"]
    log = RunLog(accelerator, args, "train_ddp", step, dp_size, global_batch_size)
    allreduce_mib = ring_allreduce_bytes(4 * n_params, dp_size) / 2**20  # fp32 gradients
    log.start(
        model_config,
        n_params,
        data,
        resume_path=resume_path,
        strategy_lines=[
            f"gradient all-reduce per step and rank (ring): 2(N-1)/N x {4 * n_params / 2**20:.1f} MiB "
            f"= {allreduce_mib:.1f} MiB"
        ],
    )
    model.train()
    while step < min(args.max_steps, args.stop_at_step or args.max_steps) and not stream.preempted:
        log.step_start()
        # The loss is normalised by the target count of the whole global batch (all micro-batches,
        # all ranks), not by per-micro-batch means, which weight tokens unequally when counts differ.
        window, global_targets = stream.next_step()
        loss_sum = torch.zeros((), device=accelerator.device)
        for mb in window:
            with accelerator.accumulate(model):  # Accelerate: skips DDP's all-reduce until the last micro-batch
                mb_loss_sum, _ = cross_entropy_sum(model(mb["input_ids"]), mb["labels"])
                # DDP averages gradients over dp_size ranks and accelerator.backward divides by
                # grad_accum: scale back so the gradient is that of (global loss sum / global targets).
                accelerator.backward(
                    mb_loss_sum * dp_size * grad_accum / global_targets
                )  # Accelerate: backward, DDP: all-reduce
                loss_sum += mb_loss_sum.detach()
        grad_norm = (
            accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm) if args.max_grad_norm > 0 else None
        )  # Accelerate: clip
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        log.step_end()

        if log.is_log_step(step):
            loss = (accelerator.reduce(loss_sum, reduction="sum") / global_targets).item()  # Accelerate: all-reduce
            log.train(step, loss, lr, grad_norm, epoch=stream.epoch)
        if log.is_eval_step(step):
            log.eval(step, evaluate(accelerator, model, eval_loader, data.task))  # gather_for_metrics inside
        if log.is_checkpoint_step(step) or stream.preempted:  # preempted: every rank saves
            state = trainer_state(step, stream, args, model_config, global_batch_size, dp_size)
            # every rank writes its part (a collective)
            save_checkpoint(accelerator, model, optimizer, scheduler, state, args.output_dir, args.keep_last)
    stream.close()

    # ---------------------------------------- save
    if step == args.max_steps:
        export_model(
            accelerator, model, model_config, data_source(args), Path(args.output_dir) / "model"
        )  # every rank; main writes
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
    del model, optimizer, scheduler, train_loader, eval_loader, stream
    accelerator.free_memory()
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    run_main(main)
