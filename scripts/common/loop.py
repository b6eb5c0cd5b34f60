"""The run around one training step, shared by the sharded strategies (FSDP, TP, PP, hybrid).

A script sets up its Accelerator, layout and model, applies its strategy, and hands over one
function, `forward_backward(window, global_targets) -> loss_sum`, which is the strategy's whole
step (plain forward/backward, or a pipeline schedule). This module runs everything else the
same way for all of them: data sharded over the data-parallel ranks only, the optimizer step
with clipping over sharded gradients, metrics, evaluation, checkpoints, the final model, and
the cost figures (bytes each rank holds, collectives of one step).

train_ddp.py keeps its loop in the file: it is the base example the others are read against.
"""
from __future__ import annotations

import math
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate.data_loader import prepare_data_loader
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel as tp_loss_parallel
from torch.utils.data import DataLoader, Subset
from tqdm.auto import tqdm

from .checkpoint import check_resume_and_output, export_model, load_checkpoint, save_checkpoint
from .data import data_source, load_data, make_train_loader
from .errors import UsageError
from .launch import check_core_args, launcher_sharding, make_accelerator
from .layout import Layout
from .metrics import MetricsWriter, Throughput, peak_flops, peak_memory_mb
from .model import GPT, count_parameters, cross_entropy_sum, flops_per_token
from .parallel import MULTI_STAGE_SCHEDULES, SCHEDULES, CollectiveCounter, bubble_theory, build_schedule, clip_grad_norm_, ddp_state_bytes, local_bytes, training_state_bytes
from .training import TrainStream, make_optimizer, make_scheduler, model_config_from_args


# ====================================================================== set-up and checks
class Run:
    """What a sharded script has set up before its strategy block: the Accelerator, the checked
    layout with its mesh, the data, the global batch and the checkpoint to resume (if any)."""

    def __init__(self, args, name: str, stages_per_rank: int = 1, check=None, **degrees):
        """`check(run)`: the script's own checks, once the layout and data are known and before
        anything is written."""
        check_core_args(args)
        sharded = launcher_sharding()
        if sharded:  # it would shard a second time on GPU, and be silently dropped on CPU (pitfall 3)
            raise UsageError(f"{name}.py applies its strategy itself with PyTorch's APIs, but the launch also asked Accelerate for {sharded}: "
                             "launch with a plain multi-process config, e.g. --config_file accelerate_configs/cpu_multi.yaml (or gpu_multi.yaml)")
        self.args, self.name = args, name
        self.model_config = model_config_from_args(args)
        # Accelerate: process group (gloo on CPU, NCCL on GPU), device, mixed precision from the launcher.
        # The scheduler counts optimizer steps (step_scheduler_with_optimizer=False), whatever the layout.
        self.accelerator = make_accelerator(args, step_scheduler_with_optimizer=False)
        check_mixed_precision(self.accelerator)
        self.layout = Layout.from_degrees(self.accelerator.num_processes, **degrees)
        self.layout.check_model(self.model_config, stages_per_rank)
        self.global_batch_size = args.batch_size * self.layout.dp * args.gradient_accumulation_steps
        # everything that can refuse the run is checked before anything is written
        self.data = load_data(args, self.accelerator, self.model_config.block_size)
        self.train_loader = make_train_loader(self.data.train, args.batch_size, self.global_batch_size, args.seed)  # refuses a split smaller than a global batch
        if check:
            check(self)
        self.resume_path = check_resume_and_output(self.accelerator, args, self.model_config, self.global_batch_size)
        self.layout.build_mesh(self.accelerator.device.type)

    def train(self, model, forward_backward, predict, strategy_lines: list[str], eval_batch_size: int | None = None, extra_summary=None) -> None:
        """Optimizer, schedule and data-parallel loaders, then the run."""
        args, accelerator = self.args, self.accelerator
        optimizer = make_optimizer(model, args)  # after sharding: it must see the sharded parameters
        scheduler = make_scheduler(optimizer, args)
        optimizer, scheduler = accelerator.prepare(optimizer, scheduler)  # Accelerate: optimizer/scheduler wrappers (not the model: the strategy owns it)
        train_sampler = self.train_loader.sampler
        train_loader = shard_loader(self.train_loader, accelerator, self.layout)
        run_training(accelerator, args, name=self.name, layout=self.layout, model=model, optimizer=optimizer, scheduler=scheduler, data=self.data,
                     model_config=self.model_config, global_batch_size=self.global_batch_size, train_loader=train_loader, train_sampler=train_sampler,
                     forward_backward=forward_backward, predict=predict, eval_batch_size=eval_batch_size or args.eval_batch_size,
                     resume_path=self.resume_path, strategy_lines=strategy_lines, extra_summary=extra_summary,
                     n_params=count_full_parameters(self.model_config))


def check_mixed_precision(accelerator) -> None:
    if accelerator.mixed_precision == "fp16":
        raise UsageError("--mixed_precision fp16 is not supported by the sharded strategies (its loss scaler does not handle sharded gradients): launch with --mixed_precision bf16 or no")


def check_tp_flags(run: Run, sequence_parallel: bool, loss_parallel: bool) -> None:
    """--sequence_parallel / --loss_parallel need a TP group; sequence parallel also needs every
    rank to get an equal slice of the sequence (gloo's collectives need equal sizes)."""
    if run.layout.tp == 1 and (sequence_parallel or loss_parallel):
        flag = "sequence_parallel" if sequence_parallel else "loss_parallel"
        raise UsageError(f"--{flag} shards over the TP group, but --tp_size is 1: use --tp_size 2 or more, or drop --{flag}")
    seq_len = run.data.seq_len
    if sequence_parallel and seq_len % run.layout.tp:
        hint = "choose --addition_digits d with 3d+4 divisible by it (d = 4 gives 16 tokens)" if run.data.task == "addition" else "use a --block_size divisible by it"
        raise UsageError(f"--sequence_parallel splits the {seq_len}-token sequence over --tp_size {run.layout.tp} ranks, which does not divide it: {hint}")


def add_pipeline_args(parser):
    g = parser.add_argument_group("pipeline parallel")
    g.add_argument("--schedule", default="1f1b", help=f"pipeline schedule: {' | '.join(SCHEDULES)}")
    g.add_argument("--n_microbatches", type=int, default=4, help="micro-batches each --batch_size is split into")
    g.add_argument("--stages_per_rank", type=int, help="stages each rank holds (None: 2 for interleaved_1f1b and zero_bubble, else 1)")
    g.add_argument("--split_points", help="comma-separated layer indices where a new stage begins, e.g. 1,3 (default: balance layers by count)")
    return g


def check_pipeline_args(args) -> None:
    """Flag-only checks, before any process group exists; fills in --stages_per_rank's default
    and parses --split_points."""
    if args.schedule not in SCHEDULES:
        raise UsageError(f"--schedule {args.schedule!r} is not supported: choose {', '.join(SCHEDULES)}")
    if args.stages_per_rank is None:
        args.stages_per_rank = 2 if args.schedule in MULTI_STAGE_SCHEDULES else 1
    if args.stages_per_rank < 1:
        raise UsageError(f"--stages_per_rank must be at least 1 (got {args.stages_per_rank})")
    if args.stages_per_rank > 1 and args.schedule not in MULTI_STAGE_SCHEDULES:
        raise UsageError(f"--stages_per_rank {args.stages_per_rank}: --schedule {args.schedule} runs one stage per rank; use interleaved_1f1b or zero_bubble, or drop --stages_per_rank")
    if args.n_microbatches < 1:
        raise UsageError(f"--n_microbatches must be at least 1 (got {args.n_microbatches})")
    if args.split_points:
        try:
            args.split_points = [int(x) for x in str(args.split_points).split(",")]
        except ValueError:
            raise UsageError(f"--split_points {args.split_points!r}: give comma-separated layer indices, e.g. 1,3") from None
    else:
        args.split_points = None


def check_pipeline_flags(run: Run, args) -> None:
    """Checks that need the layout and the model."""
    n_stages, n_layer = run.layout.pp * args.stages_per_rank, run.model_config.n_layer
    if args.batch_size % args.n_microbatches:
        raise UsageError(f"--batch_size {args.batch_size} cannot be split into --n_microbatches {args.n_microbatches} equal micro-batches: use a batch size divisible by it")
    if args.gradient_accumulation_steps != 1:
        raise UsageError("--gradient_accumulation_steps: the pipeline already accumulates over its micro-batches; raise --batch_size and --n_microbatches instead (and keep accumulation 1)")
    if args.split_points is not None:
        points = args.split_points
        if len(points) != n_stages - 1 or points != sorted(set(points)) or points[0] <= 0 or points[-1] >= n_layer:
            raise UsageError(f"--split_points {','.join(map(str, points))}: {n_stages} stages need {n_stages - 1} increasing layer indices between 1 and {n_layer - 1}")
    if run.layout.pp > 1 and args.schedule != "gpipe" and args.n_microbatches < run.layout.pp:
        raise UsageError(f"--n_microbatches {args.n_microbatches} is fewer than the {run.layout.pp} pipeline ranks: --schedule {args.schedule} needs at least one micro-batch per rank in flight (raise --n_microbatches, or use gpipe)")
    if args.schedule in ("interleaved_1f1b", "zero_bubble") and args.n_microbatches % run.layout.pp:
        raise UsageError(f"--n_microbatches {args.n_microbatches}: --schedule {args.schedule} needs a multiple of the {run.layout.pp} pipeline ranks")


# ====================================================================== the two kinds of step
def sharded_step(accelerator, model, layout: Layout, loss_parallel: bool = False):
    """The step of the strategies without a pipeline (FSDP, TP, FSDP x TP): forward and backward
    per micro-batch. The loss is normalised by the global batch's target count; FSDP averages
    gradients over the dp ranks, so it is multiplied by dp (as in train_ddp.py)."""
    from torch.distributed.fsdp import FSDPModule

    is_fsdp = isinstance(model, FSDPModule)

    def forward_backward(window, global_targets):
        step_loss_sum = torch.zeros((), device=accelerator.device)
        for i, mb in enumerate(window):
            if is_fsdp:  # FSDP2's no_sync: keep unsharded gradients, reduce-scatter once, after the last micro-batch
                model.set_requires_gradient_sync(i == len(window) - 1)
            with accelerator.autocast(), (tp_loss_parallel() if loss_parallel else nullcontext()):  # Accelerate: autocast
                loss_sum, _ = cross_entropy_sum(model(mb["input_ids"]), mb["labels"])  # vocab-sharded logits under loss parallel
                accelerator.backward(loss_sum * layout.dp / global_targets)  # Accelerate: backward
            step_loss_sum += loss_sum.detach().full_tensor() if isinstance(loss_sum, DTensor) else loss_sum.detach()
        return step_loss_sum

    def predict(input_ids):
        with accelerator.autocast():
            return model(input_ids)

    return forward_backward, predict


class PipelineStep:
    """The step under pipeline parallelism: the schedule runs forward and backward of all
    micro-batches through the stages. The last stage computes the loss of each micro-batch,
    already divided by the global target count (scale_grads=False: pitfall 9); the other
    stages return zero, and the logged loss is summed from the last stage's ranks."""

    def __init__(self, accelerator, layout: Layout, chunks, schedule: str, n_microbatches: int, loss_parallel: bool = False):
        self.accelerator, self.layout, self.loss_parallel = accelerator, layout, loss_parallel
        self.schedule, self.stages = build_schedule(chunks, layout, schedule, n_microbatches, self.loss_fn, accelerator.device)
        self.has_first = any(stage.is_first for stage in self.stages)
        self.has_last = any(stage.is_last for stage in self.stages)
        self.scale = 1.0
        self.busy_s = self.step_s = 0.0
        self.max_in_flight, self.steps = 0, 0

    def loss_fn(self, logits, labels):
        loss_sum, _ = cross_entropy_sum(logits, labels)
        return loss_sum * self.scale

    def __call__(self, window, global_targets):
        if len(window) != 1:
            raise UsageError("pipeline parallelism splits the batch into --n_microbatches itself: use --gradient_accumulation_steps 1")
        (mb,) = window
        self.scale = self.layout.dp / global_targets
        for stage in self.stages:
            stage.reset_counters()
        inputs = (mb["input_ids"],) if self.has_first else ()
        target = mb["labels"] if self.has_last else None
        losses = []  # the last stage's loss per micro-batch, as loss_fn returned it
        start = time.perf_counter()
        with self.accelerator.autocast(), (tp_loss_parallel() if self.loss_parallel else nullcontext()):  # Accelerate: autocast
            self.schedule.step(*inputs, target=target, losses=losses)
        if self.steps > 0:  # the first step also sets up the stages: leave it out of the bubble figure
            self.step_s += time.perf_counter() - start
            self.busy_s += sum(stage.busy_s for stage in self.stages)
        self.max_in_flight = max([self.max_in_flight, *(stage.max_in_flight for stage in self.stages)])
        self.steps += 1
        if not losses:
            return torch.zeros((), device=self.accelerator.device)
        losses = [loss.full_tensor() if isinstance(loss, DTensor) else loss for loss in losses]
        return torch.stack(losses).sum().detach() / self.scale  # back to this replica's loss sum

    def predict(self, input_ids):
        """Forward only, through the pipeline: the last stage gets the logits of the whole batch.
        (The schedule also evaluates its loss function there; the inputs stand in for the labels.)"""
        with self.accelerator.autocast(), (tp_loss_parallel() if self.loss_parallel else nullcontext()):
            logits = self.schedule.eval(*((input_ids,) if self.has_first else ()), target=input_ids if self.has_last else None)
        return logits if self.has_last else None

    def costs(self) -> dict:
        """This rank's share of the pipeline's time and memory (gathered over ranks by the caller)."""
        busy = self.busy_s / self.step_s if self.step_s else None
        act = max((stage.activation_bytes or 0) for stage in self.stages)
        return {"busy_fraction": busy, "max_microbatches_in_flight": self.max_in_flight,
                "activation_bytes_per_microbatch": act, "peak_activation_bytes": act * self.max_in_flight}


def pipeline_summary(run: Run, pipeline: PipelineStep, args) -> dict:
    """Per stage (pipeline rank): measured bubble, micro-batches in flight, activation memory;
    beside the theory. Collective (a gather)."""
    costs = pipeline.costs()
    row = torch.tensor([run.layout.pp_rank, -1.0 if costs["busy_fraction"] is None else costs["busy_fraction"], costs["max_microbatches_in_flight"],
                        costs["activation_bytes_per_microbatch"], costs["peak_activation_bytes"]], dtype=torch.float64, device=run.accelerator.device)
    rows = run.accelerator.gather(row[None]).cpu()  # Accelerate: all-gather
    per_stage = {int(r[0]): r for r in rows}  # one rank of each pipeline position (its replicas agree up to timing)
    ranks = sorted(per_stage)
    return {"pipeline_schedule": args.schedule, "n_microbatches": args.n_microbatches, "stages_per_rank": args.stages_per_rank,
            "bubble_theory": round(bubble_theory(run.layout.pp, args.n_microbatches, args.stages_per_rank), 4),
            "bubble_measured_per_rank": [None if per_stage[r][1] < 0 else round(1 - float(per_stage[r][1]), 4) for r in ranks],
            "max_microbatches_in_flight_per_rank": [int(per_stage[r][2]) for r in ranks],
            "activation_mib_per_microbatch_per_rank": [round(float(per_stage[r][3]) / 2**20, 4) for r in ranks],
            "peak_activation_mib_per_rank": [round(float(per_stage[r][4]) / 2**20, 4) for r in ranks]}


# ====================================================================== the run around the step
def shard_loader(loader: DataLoader, accelerator, layout: Layout) -> DataLoader:
    """Accelerate's loader sharding, over the data-parallel ranks only: every rank of one TP
    group or one pipeline gets the same micro-batches (prepare() would shard over all ranks)."""
    return prepare_data_loader(loader, device=accelerator.device, num_processes=layout.dp, process_index=layout.dp_rank, put_on_device=True)


def run_training(accelerator, args, *, name: str, layout: Layout, model, optimizer, scheduler, data, model_config, global_batch_size: int,
                 train_loader, train_sampler, forward_backward, predict, eval_batch_size: int, resume_path, strategy_lines: list[str],
                 extra_summary=None, n_params: int) -> None:
    """Everything around `forward_backward`, the same for every sharded strategy."""
    progress = {"step": 0, "epoch": 0, "samples_in_epoch": 0}
    if resume_path:
        progress = load_checkpoint(accelerator, resume_path, model, optimizer, scheduler)
    stream = TrainStream(accelerator, train_loader, train_sampler, global_batch_size, args.gradient_accumulation_steps,
                         progress["epoch"], progress["samples_in_epoch"], dp_group=layout.group("dp"))
    pp_group = layout.group("pp") if layout.pp > 1 else None

    tokens_per_step = global_batch_size * data.seq_len
    throughput = Throughput(flops_per_token(model_config, n_params, data.seq_len), peak_flops(accelerator.device, args.peak_flops))
    metrics = MetricsWriter(args.output_dir, accelerator.is_main_process)
    accelerator.init_trackers(name, config={k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))})  # Accelerate: trackers
    param_bytes = _gather_max(accelerator, local_bytes(model.parameters()))
    per_state = 4 if args.optimizer == "adamw" else 2  # parameters, gradients (+ two Adam moments), fp32
    ddp_bytes = ddp_state_bytes(n_params, args.optimizer)["total_bytes"]
    accelerator.print(  # Accelerate: prints on the main process only
        f"{name}: {layout.world_size} process(es) on {accelerator.device} ({accelerator.distributed_type}), mixed precision {accelerator.mixed_precision}\n"
        f"{layout.table()}\n"
        f"  model {args.model_size}: {n_params / 1e6:.2f}M parameters, {model_config.n_layer} layers x {model_config.n_embd} wide\n"
        f"  data {data.task}: {len(data.train)} train / {len(data.validation)} validation samples of {data.seq_len} tokens\n"
        f"  global batch = {args.batch_size} per data-parallel rank x {layout.dp} dp ranks x {args.gradient_accumulation_steps} accumulation = {global_batch_size} samples\n"
        f"  parameters per rank (largest): {param_bytes / 2**20:.2f} MiB of the unsharded {4 * n_params / 2**20:.2f} MiB; "
        f"with gradients and optimizer state ~{per_state * param_bytes / 2**20:.2f} MiB (DDP: {ddp_bytes / 2**20:.2f} MiB, ideal split over {layout.model_split}: {ddp_bytes / layout.model_split / 2**20:.2f} MiB)\n"
        + "".join(f"  {line}\n" for line in strategy_lines)
        + (f"  resuming from {resume_path} at step {progress['step']}" if resume_path else "")
    )

    step, start_step, run_start = progress["step"], progress["step"], time.perf_counter()
    comm, state_bytes = {}, {}
    bar = tqdm(total=args.max_steps, initial=step, desc="train", disable=not accelerator.is_main_process, dynamic_ncols=True)
    model.train()
    last_step = min(args.max_steps, args.stop_at_step or args.max_steps)
    while step < last_step:
        step_start = time.perf_counter()
        window, global_targets = stream.next_step()
        if step == start_step:  # the first step of the run is measured: which collectives, how many bytes
            with CollectiveCounter() as counter:
                loss_sum = forward_backward(window, global_targets)
            comm = counter.report()
        else:
            loss_sum = forward_backward(window, global_targets)
        # gradients may be sharded (DTensor) and split over stages: the norm is the whole model's
        grad_norm = clip_grad_norm_(model.parameters(), args.max_grad_norm or float("inf"), pp_group)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        if step == start_step:
            state_bytes = training_state_bytes(model, optimizer)  # exact: local shards of params, grads, Adam moments
            if accelerator.is_main_process:
                bar.write(f"  measured on the first step (rank 0): parameters + gradients + optimizer state {state_bytes['total_bytes'] / 2**20:.2f} MiB; collectives "
                          + (", ".join(f"{k} {v['calls']} calls / {v['mib']:.3f} MiB" for k, v in comm.items()) or "none"))
        optimizer.zero_grad(set_to_none=True)
        step += 1
        throughput.add(tokens_per_step, time.perf_counter() - step_start)
        bar.update(1)

        if step % args.log_every == 0 or step == args.max_steps:
            # one rank per data-parallel replica holds its part of the loss sum (pitfall 5)
            loss = accelerator.reduce(loss_sum if layout.holds_loss else torch.zeros_like(loss_sum), reduction="sum")  # Accelerate: all-reduce
            loss = (loss / global_targets).item()
            record = {"type": "train", "step": step, "loss": loss, "lr": lr, "grad_norm": float(grad_norm) if args.max_grad_norm else None,
                      "global_batch_size": global_batch_size, "world_size": layout.world_size, "layout": layout.describe(),
                      "epoch": stream.epoch, **throughput.report(layout.world_size)}
            metrics.write(record)
            accelerator.log({k: v for k, v in record.items() if isinstance(v, float)}, step=step)  # Accelerate: trackers
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{record['tokens_per_sec']:.0f}")
        if (args.eval_every and step % args.eval_every == 0) or step == args.max_steps:
            model.eval()
            result = evaluate_parallel(predict, data.validation, eval_batch_size, layout, accelerator.device, data.task)
            model.train()
            metrics.write({"type": "eval", "step": step, **result, "elapsed_s": round(time.perf_counter() - run_start, 2)})
            accelerator.log({k: v for k, v in result.items() if k != "num_samples"}, step=step)
            if accelerator.is_main_process:
                bar.write(f"step {step}: " + ", ".join(f"{k} {v}" for k, v in result.items()))
        if (args.checkpoint_every and step % args.checkpoint_every == 0) or step == args.stop_at_step:
            state = {"step": step, **stream.position(), "global_batch_size": global_batch_size, "world_size": layout.world_size,
                     "layout": layout.describe(), "seed": args.seed, "model_config": model_config.to_dict()}
            save_checkpoint(accelerator, model, optimizer, scheduler, state, args.output_dir, args.keep_last)  # every rank
    bar.close()
    stream.close()

    if step == args.max_steps:
        export_model(accelerator, model, model_config, data_source(args), Path(args.output_dir) / "model", layout=layout)  # every rank
    elapsed = time.perf_counter() - run_start
    measured = {k: _gather_max(accelerator, state_bytes.get(k, 0)) for k in ("param_bytes", "grad_bytes", "optimizer_bytes", "total_bytes")}
    summary = {"type": "summary", "steps": step - start_step, "final_step": step, "time_s": round(elapsed, 2),
               **throughput.summary(layout.world_size), "n_params": n_params, "global_batch_size": global_batch_size,
               "world_size": layout.world_size, "layout": layout.describe(),
               "peak_memory_mb_max_rank": round(_gather_max(accelerator, peak_memory_mb(accelerator.device)), 1),
               "state_bytes_per_rank_max": measured, "ddp_state_bytes_per_rank": ddp_state_bytes(n_params, args.optimizer),
               # the ideal: DDP's bytes split evenly over every rank that holds a different piece of the model
               "ideal_state_bytes_per_rank": round(ddp_bytes / layout.model_split), "state_vs_ideal": round(measured["total_bytes"] / (ddp_bytes / layout.model_split), 4),
               "unsharded_param_bytes": 4 * n_params, "collectives_first_step_rank0": comm,
               **(extra_summary() if extra_summary else {})}
    metrics.write(summary)
    saved = f"model saved to {Path(args.output_dir) / 'model'}" if step == args.max_steps else f"stopped at step {step}: continue with --resume_from_checkpoint latest"
    accelerator.print(f"done: {summary}\n{saved}; metrics in {metrics.path}")
    accelerator.wait_for_everyone()
    accelerator.end_training()  # Accelerate: closes trackers, destroys the process group


@torch.no_grad()
def evaluate_parallel(predict, validation, batch_size: int, layout: Layout, device, task: str) -> dict:
    """Eval loss and task metric over every validation sample exactly once, under any layout.

    Data-parallel rank r scores samples r, r + dp, ...; every rank runs the same number of full
    batches (padded, the padding masked out), because FSDP and the pipeline need all ranks in
    each forward. `predict(input_ids)` returns the logits where they exist (last stage) and
    None elsewhere; one rank per data-parallel replica (`layout.holds_loss`) contributes its
    sums, so the all-reduce adds each sample once (pitfall 5: not once per TP rank)."""
    n, dp, r = len(validation), layout.dp, layout.dp_rank
    n_batches = math.ceil(math.ceil(n / dp) / batch_size)
    mine = list(range(r, n, dp))
    real = torch.zeros(n_batches * batch_size, dtype=torch.bool)
    real[: len(mine)] = True
    indices = (mine + [mine[0]] * (n_batches * batch_size))[: n_batches * batch_size]
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss, targets, correct samples, samples
    for i, batch in enumerate(DataLoader(Subset(validation, indices), batch_size=batch_size)):
        logits = predict(batch["input_ids"].to(device))
        logits = logits.full_tensor() if isinstance(logits, DTensor) else logits  # loss parallel: a collective, on every TP rank
        if logits is None or not layout.holds_loss:
            continue
        mask = real[i * batch_size : (i + 1) * batch_size].to(device)
        targets = batch["labels"][:, 1:].to(device)
        is_target = (targets != -100) & mask[:, None]
        token_loss = F.cross_entropy(logits[:, :-1].transpose(1, 2).float(), targets.masked_fill(~is_target, -100), ignore_index=-100, reduction="none")
        correct = ((logits[:, :-1].argmax(-1) == targets) | ~is_target).all(dim=1) & mask
        sums += torch.stack([token_loss.sum(), is_target.sum(), correct.sum(), mask.sum()]).double()
    dist.all_reduce(sums)
    eval_loss = (sums[0] / sums[1]).item()
    result = {"eval_loss": eval_loss, "num_samples": int(sums[3].item())}
    if task == "addition":
        result["exact_match"] = (sums[2] / sums[3]).item()
    else:
        result["perplexity"] = round(math.exp(min(eval_loss, 50)), 4)
    return result


def _gather_max(accelerator, value: float) -> float:
    return accelerator.gather(torch.tensor([float(value)], device=accelerator.device)).max().item()  # Accelerate: all-gather


def count_full_parameters(model_config) -> int:
    """Parameters of the whole model (a rank may hold only a part or a shard of it)."""
    with torch.device("meta"):
        return count_parameters(GPT(model_config))
