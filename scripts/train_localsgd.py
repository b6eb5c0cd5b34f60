#!/usr/bin/env python
"""Local SGD: train apart, fuse by averaging the parameters every K steps (🤗 Accelerate's LocalSGD).

DDP all-reduces the gradients at every step. Local SGD lets every rank take K optimizer steps
on its own data without talking to anyone, then averages the parameters once:

    rank 0:  step step step step | average the | step step step step | average ...
    rank 1:  step step step step | parameters  | step step step step |
             <--- K local steps, no communication --->  one all-reduce of 4Ψ bytes (K x fewer than DDP)

What is averaged: the parameters, and nothing else. Each rank keeps its own optimizer state
(Adam moments drift apart between fusions and are never reconciled); buffers are not averaged (the
built-in model has none). What follows: with plain SGD, no clipping and K = 1 this IS data parallelism
(averaging the parameters after a linear update equals averaging the gradients); with Adam, or K > 1, the
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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts run as files: copy common/ beside this file

import torch
from accelerate import DistributedType
from accelerate.local_sgd import LocalSGD
from accelerate.utils import set_seed

from common.checkpoint import check_resume_and_output, export_model, load_checkpoint, save_checkpoint
from common.data import data_source, load_data, make_train_loader
from common.errors import UsageError
from common.launch import build_parser, check_core_args, launcher_sharding, make_accelerator, run_main
from common.metrics import RunMonitor, evaluate, replicated_summary, ring_allreduce_bytes
from common.model import context_length, count_parameters, language_model, tokenizer_for
from common.task import check_loss_is_a_sum
from common.training import StepFeed, compile_units, make_optimizer, make_scheduler


# ======================================== Local SGD: the strategy
def local_forward_backward(accelerator, model, task, micro_batches: list, global_targets, dp_size: int) -> torch.Tensor:
    """Forward and backward of this rank's micro-batches; returns their loss sum. The gradients stay
    local (LocalSGD keeps DDP in no_sync). The loss is normalised by the target count of the whole
    global batch (all micro-batches, all ranks), as in train_ddp.py, and multiplied by dp_size
    because the fusion averages the replicas: K = 1 with plain SGD is then DDP."""
    step_loss_sum = torch.zeros((), device=accelerator.device)
    for mb in micro_batches:
        loss_sum, _ = task.loss_of(model, mb)
        accelerator.backward(loss_sum * dp_size / global_targets)  # Accelerate: backward
        step_loss_sum += loss_sum.detach()
    return step_loss_sum


def parameter_fingerprint(model) -> torch.Tensor:
    """One number that differs when any parameter differs (a position-weighted sum, in float64)."""
    return sum((i + 1) * p.detach().double().sum() for i, p in enumerate(model.parameters()))


def replica_spread(accelerator, model) -> float:
    """How far apart the replicas are: the spread of their fingerprints over the ranks, 0 right
    after a fusion. Collective."""
    fingerprints = accelerator.gather(parameter_fingerprint(model).reshape(1))  # Accelerate: all-gather
    return (fingerprints.max() - fingerprints.min()).item()


def replicas(accelerator, model, step: int, sync_every: int) -> dict:
    """What a train record adds: whether `step` ended with a fusion, and the replicas' spread."""
    fused = accelerator.num_processes > 1 and step % sync_every == 0
    return {"fused": fused, "param_spread": replica_spread(accelerator, model)}


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
    # Accelerate: process group (gloo on CPU, NCCL on GPU), device, mixed precision from the launcher.
    # cpu=True where CUDA is missing: the N processes then join one gloo group (without it, each trains alone).
    # The scheduler counts optimizer steps (step_scheduler_with_optimizer=False), whatever the layout.
    accelerator = make_accelerator(
        args,
        cpu=args.cpu or not torch.cuda.is_available(),
        step_scheduler_with_optimizer=False,
    )
    if accelerator.distributed_type not in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
        raise UsageError(
            f"Local SGD averages whole replicas: it cannot run under {accelerator.distributed_type}; launch without "
            "an FSDP/DeepSpeed config"
        )
    dp_size = accelerator.num_processes  # Local SGD: every process is a replica, holding the whole model
    global_batch_size = args.batch_size * dp_size * grad_accum

    # ---------------------------------------- data (checked before anything is written)
    data = load_data(args, accelerator, context_length(args), tokenizer_for(args))
    train_loader = make_train_loader(data.train, args.batch_size, global_batch_size, args.seed)

    # ---------------------------------------- MODEL: the only lines that name the model (docs/your-model.md)
    set_seed(args.seed)  # Accelerate: the same full model on every rank: the replicas start equal
    # the built-in GPT, or a 🤗 transformers causal LM (--model_name_or_path, --model_config), and its Task:
    # the loss of a micro-batch as (loss_sum, n_targets), the targets it counts, its evaluation and export
    model, task = language_model(args, data)
    model = model.to(accelerator.device)
    n_params, model_line = count_parameters(model), task.describe(model)
    resume_path, facts = check_resume_and_output(accelerator, args, model, task, global_batch_size)
    if args.compile:
        compile_units(
            task.units(model), accelerator
        )  # each repeated unit, before DDP wraps the model: its all-reduce hooks stay outside

    # ---------------------------------------- optimizer
    optimizer = make_optimizer(model, args)
    scheduler = make_scheduler(optimizer, args)
    train_sampler = train_loader.sampler

    # ---------------------------------------- Local SGD: the strategy
    # Accelerate: wraps the model in DistributedDataParallel (kept in no_sync by LocalSGD below),
    # moves everything to the device, and shards the loader: rank r takes every dp_size-th micro-batch.
    model, optimizer, train_loader, scheduler = accelerator.prepare(model, optimizer, train_loader, scheduler)
    # Local SGD: LocalSGD keeps DDP in no_sync() from here on (no gradient all-reduce), averages the parameters
    # in local_sgd.step() every K steps, and once more in local_sgd.__exit__(), after the loop.
    local_sgd = LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=args.sync_every, enabled=dp_size > 1)
    local_sgd.__enter__()

    check_loss_is_a_sum(task, model, data.validation, accelerator.device)  # a mean would train silently wrong
    progress = load_checkpoint(accelerator, resume_path, model, optimizer, scheduler)  # step 0 without a checkpoint
    local_sgd.num_steps = progress["step"]  # Local SGD: a resumed run fuses at the same steps as an uninterrupted one
    feed = StepFeed(
        accelerator,
        train_loader,
        train_sampler,
        global_batch_size,
        grad_accum,
        progress,
        task.count_targets,
    )
    monitor = RunMonitor(accelerator, args, "train_localsgd", progress["step"], dp_size, global_batch_size)
    fusion_mib = ring_allreduce_bytes(4 * n_params, dp_size) / 2**20  # fp32 parameters, once per fusion
    fusion_line = f"Local SGD: fusing every {args.sync_every} steps; {fusion_mib:.1f} MiB per fusion and rank"
    per_step = f"{fusion_mib / args.sync_every:.2f} MiB per step (DDP: {fusion_mib:.1f} MiB per step)"
    monitor.start(task, model_line, n_params, data, [f"{fusion_line} = {per_step}"], resume_path)

    # ---------------------------------------- the training loop
    step, last_step = progress["step"], min(args.max_steps, args.stop_at_step or args.max_steps)
    model.train()
    while step < last_step and not feed.preempted:
        monitor.step_start()
        micro_batches, global_targets = feed.next_step()
        # Local SGD: forward and backward of each micro-batch; the gradients stay on this rank
        loss_sum = local_forward_backward(accelerator, model, task, micro_batches, global_targets, dp_size)
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm or float("inf"))
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        local_sgd.step()  # Local SGD: every sync_every-th step, average the parameters over the ranks
        step += 1
        monitor.step_end()

        if monitor.due(step, "train"):
            loss = (accelerator.reduce(loss_sum, reduction="sum") / global_targets).item()  # Accelerate: all-reduce
            fusion = replicas(accelerator, model, step, args.sync_every)  # Local SGD: fused? how far apart?
            monitor.train(step, loss, lr, grad_norm, **fusion, epoch=feed.epoch)
        if monitor.due(step, "eval") and step < args.max_steps:  # Local SGD: the last one scores the fused model
            # between fusions each rank scores its share of the samples with its own replica
            monitor.eval(step, evaluate(accelerator, model, task, data.validation, args.eval_batch_size))
        if (
            monitor.due(step, "checkpoint") or feed.preempted
        ):  # Local SGD: the replicas differ: every rank saves its own
            save_checkpoint(accelerator, args, step, feed, model, optimizer, scheduler, facts, per_rank_state=True)
    feed.close()

    # ---------------------------------------- save
    if args.save_rank_models and step == args.max_steps:  # Local SGD: every rank writes its own, before the fusion
        local_state = {k.removeprefix("module."): v.detach().cpu() for k, v in model.state_dict().items()}
        rank_dir = Path(args.output_dir) / "rank_models" / f"rank_{accelerator.process_index}"
        task.export(local_state, rank_dir, data_source(args))
    local_sgd.__exit__(None, None, None)  # Local SGD: the final fusion (it waits for every rank); DDP leaves no_sync
    start_step, sync_every = progress["step"], args.sync_every
    # Local SGD: the fusions of this run: at the multiples of K, and the last one unless it fell on one
    fusions = step // sync_every - start_step // sync_every + (step % sync_every != 0) if dp_size > 1 else 0
    if step == args.max_steps:  # every rank: the main process writes
        result = evaluate(accelerator, model, task, data.validation, args.eval_batch_size)
        monitor.eval(step, result, fused_model=True, param_spread=replica_spread(accelerator, model))
        export_model(accelerator, model, task, data_source(args), Path(args.output_dir) / "model")  # the fused model
    n_tensors = len(list(model.parameters()))
    costs = replicated_summary(accelerator, n_params, 0.0)  # no gradient all-reduce: parameters, once per fusion
    monitor.summary(
        step,
        preempted=feed.preempted,
        **costs,
        sync_every=sync_every,
        fusions=fusions,
        param_allreduce_calls=fusions * n_tensors,
        param_allreduce_mib_per_rank=round(fusions * fusion_mib, 3),
        allreduce_mib_per_step_per_rank=round(fusions * fusion_mib / max(1, step - start_step), 4),
        ddp_allreduce_mib_per_step_per_rank=round(fusion_mib, 4) if dp_size > 1 else 0.0,
    )
    if args.save_rank_models and step == args.max_steps:
        accelerator.print(
            f"each rank's model before the final fusion: {Path(args.output_dir) / 'rank_models'}/rank_<r> "
            "(fuse them with scripts/merge_checkpoints.py)"
        )
    del model, optimizer, scheduler, train_loader, feed, local_sgd  # free DDP's wrapper while every peer is there
    accelerator.free_memory()
    accelerator.wait_for_everyone()
    accelerator.end_training()  # Accelerate: closes trackers and destroys the process group


if __name__ == "__main__":
    run_main(main)
