#!/usr/bin/env python
"""Local SGD: train apart, fuse by averaging the parameters every K steps (🤗 Accelerate's LocalSGD).

DDP all-reduces the gradients at every step. Local SGD lets every rank take K optimizer steps
on its own data without talking to anyone, then averages the parameters once:

    rank 0:  step step step step | average the | step step step step | average ...
    rank 1:  step step step step | parameters  | step step step step |
             <--- K local steps, no communication --->  one all-reduce of 4Ψ bytes (K x fewer than DDP)

What is averaged: the parameters, and nothing else. Each rank keeps its own optimizer state
(Adam moments drift apart between fusions and are never reconciled); the model has no buffers.
What follows: with plain SGD, no clipping and K = 1 this IS data parallelism (averaging the
parameters after a linear update equals averaging the gradients); with Adam, or K > 1, the
replicas wander apart between fusions and the fused model is an average of K-step-apart models:
less communication, bought with some accuracy per step (benchmarks/bench_localsgd.py measures it).

Each rank divides its loss sum by the target count of the whole global batch, as DDP does: the
count travels one step ahead in a small asynchronous all-reduce that no step waits for. Dividing
by each rank's own count would weight ranks equally rather than tokens, and K = 1 would then not
be DDP whenever samples have different numbers of targets (docs/troubleshooting.md, "Local SGD
with K = 1 differs from DDP").

Run it:
    accelerate launch --config_file accelerate_configs/cpu_multi.yaml scripts/train_localsgd.py \\
        --sync_every 8 --save_rank_models
    python scripts/merge_checkpoints.py runs/localsgd/rank_models/rank_0 runs/localsgd/rank_models/rank_1 \\
        --out runs/fused/model
Lines marked `# Accelerate:` are the library's part; `# Local SGD:` marks what differs from train_ddp.py.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts run as files: make `common` importable

import torch
from accelerate import DistributedType
from accelerate.local_sgd import LocalSGD
from accelerate.utils import set_seed

from common.checkpoint import check_resume_and_output, export_model, load_checkpoint, save_checkpoint, write_model_dir
from common.data import data_source, load_data, make_eval_loader, make_train_loader
from common.errors import UsageError
from common.launch import build_parser, check_core_args, launcher_sharding, make_accelerator, run_main
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


def parameter_fingerprint(model) -> torch.Tensor:
    """One number that differs when any parameter differs (a position-weighted sum, in float64)."""
    return sum((i + 1) * p.detach().double().sum() for i, p in enumerate(model.parameters()))


def main():
    # ---------------------------------------- flags
    parser = build_parser(__doc__)
    g = parser.add_argument_group("Local SGD")
    g.add_argument(
        "--sync_every", type=int, default=8, help="average the parameters every K optimizer steps (and at the end)"
    )
    g.add_argument(
        "--save_rank_models",
        action="store_true",
        help="every rank also saves its own model right before the final fusion, to OUTPUT_DIR/rank_models/rank_<r> "
        "(for merge_checkpoints.py)",
    )
    args = parser.parse_args()
    args.output_dir = args.output_dir or "runs/localsgd"
    check_core_args(args)
    if args.sync_every < 1:
        raise UsageError(
            f"--sync_every must be at least 1 (got {args.sync_every}): the number of local steps between two fusions"
        )
    model_config = model_config_from_args(args)
    grad_accum = args.gradient_accumulation_steps

    # ---------------------------------------- Accelerator
    # Local SGD averages whole replicas: a sharded strategy has none. On CPU Accelerate would silently
    # drop an FSDP config, so the launcher's flags are checked, not only the result.
    sharded = launcher_sharding()
    if sharded:
        raise UsageError(
            f"Local SGD averages whole replicas and cannot run under {sharded} (a sharded strategy): launch without "
            "an FSDP/DeepSpeed config, e.g. --config_file accelerate_configs/cpu_multi.yaml"
        )
    accelerator = make_accelerator(args, step_scheduler_with_optimizer=False)  # Accelerate: process group, device
    if accelerator.distributed_type not in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
        raise UsageError(
            f"Local SGD averages whole replicas: it cannot run under {accelerator.distributed_type}; launch without "
            "an FSDP/DeepSpeed config"
        )
    dp_size = accelerator.num_processes
    global_batch_size = args.batch_size * dp_size * grad_accum

    # ---------------------------------------- data (checked before anything is written)
    data = load_data(args, accelerator, model_config.block_size)
    train_loader = make_train_loader(data.train, args.batch_size, global_batch_size, args.seed)
    eval_loader = make_eval_loader(data.validation, args.eval_batch_size)
    resume_path = check_resume_and_output(accelerator, args, model_config, global_batch_size)

    # ---------------------------------------- model
    set_seed(args.seed)  # Accelerate: same seed on every rank, so the replicas start equal
    model = GPT(model_config).to(accelerator.device)
    n_params = count_parameters(model)
    if args.compile:
        compile_blocks(model, accelerator)  # each block, before DDP wraps the model

    # ---------------------------------------- optimizer
    optimizer = make_optimizer(model, args)
    scheduler = make_scheduler(optimizer, args)
    train_sampler = train_loader.sampler
    # Accelerate: DDP wrapper (kept in no_sync by LocalSGD below), devices, loader sharding
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler
    )
    progress = load_checkpoint(accelerator, resume_path, model, optimizer, scheduler)  # step 0 without a checkpoint
    stream = TrainStream(accelerator, train_loader, train_sampler, global_batch_size, grad_accum, progress)

    # ---------------------------------------- the training loop
    step = start_step = progress["step"]
    log = RunLog(accelerator, args, "train_localsgd", step, dp_size, global_batch_size)
    fusion_mib = ring_allreduce_bytes(4 * n_params, dp_size) / 2**20  # fp32 parameters, once per fusion
    log.start(
        model_config,
        n_params,
        data,
        resume_path=resume_path,
        strategy_lines=[
            f"Local SGD: fusing every {args.sync_every} steps; {fusion_mib:.1f} MiB per fusion and rank = "
            f"{fusion_mib / args.sync_every:.2f} MiB per step (DDP: {fusion_mib:.1f} MiB per step)"
        ],
    )
    fusions = 0
    model.train()
    # Local SGD: LocalSGD keeps DDP in no_sync() for the whole block (no gradient all-reduce),
    # averages the parameters in local_sgd.step() every K steps, and once more on leaving the block.
    with LocalSGD(
        accelerator=accelerator, model=model, local_sgd_steps=args.sync_every, enabled=dp_size > 1
    ) as local_sgd:
        local_sgd.num_steps = step  # Local SGD: a resumed run fuses at the same steps as an uninterrupted one
        while step < min(args.max_steps, args.stop_at_step or args.max_steps) and not stream.preempted:
            log.step_start()
            window, global_targets = stream.next_step()
            loss_sum = torch.zeros((), device=accelerator.device)
            for mb in window:
                mb_loss_sum, _ = cross_entropy_sum(model(mb["input_ids"]), mb["labels"])
                # Local SGD: gradients stay local; times dp_size because the fusion averages the replicas
                accelerator.backward(mb_loss_sum * dp_size / global_targets)
                loss_sum += mb_loss_sum.detach()
            grad_norm = (
                accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm) if args.max_grad_norm > 0 else None
            )
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            local_sgd.step()  # Local SGD: every sync_every-th step, average the parameters over the ranks
            fused = dp_size > 1 and (step + 1) % args.sync_every == 0
            fusions += fused
            step += 1
            log.step_end()

            if log.is_log_step(step):
                loss = (accelerator.reduce(loss_sum, reduction="sum") / global_targets).item()  # Accelerate: all-reduce
                fingerprints = accelerator.gather(
                    parameter_fingerprint(model).reshape(1)
                )  # how far apart the replicas are
                log.train(
                    step,
                    loss,
                    lr,
                    grad_norm,
                    fused=fused,
                    param_spread=(fingerprints.max() - fingerprints.min()).item(),
                    epoch=stream.epoch,
                )
            if args.eval_every and step % args.eval_every == 0 and step < args.max_steps:
                # between fusions each rank scores its shard with its own replica: a mix of the replicas
                log.eval(step, evaluate(accelerator, model, eval_loader, data.task))
            if log.is_checkpoint_step(step) or stream.preempted:  # preempted: every rank saves
                state = trainer_state(step, stream, args, model_config, global_batch_size, dp_size)
                # Local SGD: the replicas (and their optimizer states) differ: every rank saves its own
                save_checkpoint(
                    accelerator,
                    model,
                    optimizer,
                    scheduler,
                    state,
                    args.output_dir,
                    args.keep_last,
                    per_rank_state=True,
                )
        stream.close()
        if args.save_rank_models and step == args.max_steps:  # every rank writes its own, before the final fusion
            local_state = {k.removeprefix("module."): v.detach().cpu() for k, v in model.state_dict().items()}
            rank_dir = Path(args.output_dir) / "rank_models" / f"rank_{accelerator.process_index}"
            write_model_dir(local_state, model_config, data_source(args), rank_dir)
        accelerator.wait_for_everyone()
    fusions += dp_size > 1 and step % args.sync_every != 0  # leaving the block fused once more

    # ---------------------------------------- save
    if step == args.max_steps:
        final_spread = accelerator.gather(parameter_fingerprint(model).reshape(1))
        log.eval(
            step,
            evaluate(accelerator, model, eval_loader, data.task),
            fused_model=True,  # the fused model
            param_spread=(final_spread.max() - final_spread.min()).item(),
        )
        export_model(
            accelerator, model, model_config, data_source(args), Path(args.output_dir) / "model"
        )  # the fused model
    steps_run = max(1, step - start_step)
    peak_mb = accelerator.gather(
        torch.tensor([peak_memory_mb(accelerator.device)], device=accelerator.device)
    )  # Accelerate: all-gather
    n_tensors = len(list(model.parameters()))
    log.summary(
        step,
        preempted=stream.preempted,
        n_params=n_params,
        sync_every=args.sync_every,
        fusions=fusions,
        param_allreduce_calls=fusions * n_tensors,
        param_allreduce_mib_per_rank=round(fusions * fusion_mib, 3),
        allreduce_mib_per_step_per_rank=round(fusions * fusion_mib / steps_run, 4),
        ddp_allreduce_mib_per_step_per_rank=round(fusion_mib, 4) if dp_size > 1 else 0.0,
        peak_memory_mb_max_rank=round(peak_mb.max().item(), 1),
    )
    if args.save_rank_models and step == args.max_steps:
        accelerator.print(
            f"each rank's model before the final fusion: {Path(args.output_dir) / 'rank_models'}/rank_<r> "
            "(fuse them with scripts/merge_checkpoints.py)"
        )
    del model, optimizer, scheduler, train_loader, eval_loader, stream, local_sgd
    accelerator.free_memory()
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    run_main(main)
