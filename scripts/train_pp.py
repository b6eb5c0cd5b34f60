#!/usr/bin/env python
"""Pipeline parallelism with torch.distributed.pipelining, under 🤗 Accelerate.

The model is cut by layers into stages, one per rank (embeddings with the first blocks, final
norm and head with the last). Activations flow forward from stage to stage and gradients flow
back. To keep every stage busy, each batch is split into micro-batches that follow each other
through the pipe; the schedule decides the order:

    GPipe, 4 stages, 4 micro-batches (F = forward, B = backward, . = idle: the bubble)
    stage 0: F0 F1 F2 F3 .  .  .  .  .  .  B3 B2 B1 B0
    stage 1: .  F0 F1 F2 F3 .  .  .  .  B3 B2 B1 B0 .
    stage 2: .  .  F0 F1 F2 F3 .  .  B3 B2 B1 B0 .  .
    stage 3: .  .  .  F0 F1 F2 F3 B3 B2 B1 B0 .  .  .      every stage holds 4 micro-batches' activations

    1F1B: same bubble, but each stage starts backward as soon as it can, so it holds at most
    (stages - its index) micro-batches' activations instead of all of them
    stage 0: F0 F1 F2 F3 .  .  .  B0 .  B1 .  B2 .  B3
    stage 3: .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .  .

    bubble (idle fraction) of both: (p - 1) / (m + p - 1) for p stages and m micro-batches.
    interleaved 1F1B (--stages_per_rank 2): each rank holds 2 smaller stages, bubble / 2.
    zero bubble: backward split into input-gradient and weight-gradient parts; the weight parts fill the bubble.

Run it:
    accelerate launch --config_file accelerate_configs/cpu_multi.yaml scripts/train_pp.py \\
        --pp_size 2 --schedule 1f1b
    accelerate launch ... --num_processes 4 scripts/train_pp.py \\
        --n_layer 8 --schedule interleaved_1f1b --n_microbatches 8
--batch_size is the per-replica batch the schedule splits into --n_microbatches (use it instead
of gradient accumulation); evaluation runs through the pipeline with the same batch shape.
With --pp_size smaller than the number of processes, the remaining factor trains data parallel
(FSDP, with `apply_fsdp` from train_fsdp.py). Lines marked `# PP:` are the strategy.
"""

import sys
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts run as files: make `common` importable

import torch
import torch.nn as nn
from accelerate.utils import set_seed
from torch.distributed.pipelining import PipelineStage, schedules
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

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

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "zero_bubble")  # several stages per rank


# ======================================== PP: the strategy
def stage_layers(n_layer: int, n_stages: int, split_points: list[int] | None = None) -> list[range]:
    """Layers of each stage: balanced by count (earlier stages take the remainder), or cut
    before each layer in `split_points`."""
    if split_points:
        cuts = [0, *split_points, n_layer]
    else:
        base, extra = divmod(n_layer, n_stages)
        cuts = [0]
        for s in range(n_stages):
            cuts.append(cuts[-1] + base + (1 if s < extra else 0))
    return [range(a, b) for a, b in zip(cuts, cuts[1:], strict=False)]


def stages_of_rank(pp_rank: int, pp_size: int, stages_per_rank: int) -> list[int]:
    """Looped placement: rank r holds stages r, r + pp, r + 2pp ... (what the interleaved
    schedules expect)."""
    return [pp_rank + k * pp_size for k in range(stages_per_rank)]


class PipelineChunk(nn.Module):
    """One pipeline stage: a view onto some layers of this rank's model. It owns nothing: its
    parts are the model's modules, so the model's parameter names (and checkpoints) are
    untouched. The first stage embeds, the last applies the final norm and head, with the
    model's own code (GPT.embed / GPT.head)."""

    def __init__(self, model: GPT, layers: range, is_first: bool, is_last: bool):
        super().__init__()
        self.tok_emb, self.pos_emb, self.drop = (
            (model.tok_emb, model.pos_emb, model.drop) if is_first else (None, None, None)
        )
        self.blocks = nn.ModuleList(model.blocks[str(i)] for i in layers)
        self.ln_f, self.lm_head = (model.ln_f, model.lm_head) if is_last else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:
            x = GPT.embed(self, x)  # token ids -> hidden states
        for block in self.blocks:
            x = block(x)
        if self.lm_head is not None:
            x = GPT.head(self, x)  # hidden states -> logits
        return x


def split_pipeline(
    model: GPT, layout: Layout, stages_per_rank: int = 1, split_points: list[int] | None = None
) -> list[PipelineChunk]:
    """Cut the model into pp x stages_per_rank stages; this rank keeps only its stages' layers
    (the others are deleted, so their memory is freed) and gets one view per stage."""
    n_stages = layout.pp * stages_per_rank
    layers = stage_layers(model.config.n_layer, n_stages, split_points)
    mine = stages_of_rank(layout.pp_rank, layout.pp, stages_per_rank)
    keep = {i for s in mine for i in layers[s]}
    for i in range(model.config.n_layer):
        if i not in keep:
            del model.blocks[str(i)]
    if 0 not in mine:
        model.tok_emb = model.pos_emb = None
    if n_stages - 1 not in mine:
        model.ln_f = model.lm_head = None
    return [PipelineChunk(model, layers[s], is_first=s == 0, is_last=s == n_stages - 1) for s in mine]


class TimedStage(PipelineStage):
    """A PipelineStage that measures what the schedule costs this rank: the time it computes
    (forward, backward, weight gradients), the most micro-batches whose activations it holds at
    once, and the bytes autograd saves for one micro-batch's backward."""

    def reset_counters(self) -> None:
        self.busy_s, self.max_in_flight = 0.0, 0
        if not hasattr(self, "activation_bytes"):
            self.activation_bytes = None

    def forward_one_chunk(self, *args, **kwargs):
        start = time.perf_counter()
        measure = self.activation_bytes is None and torch.is_grad_enabled()
        storages: dict[int, int] = {}

        def pack(t):  # every tensor autograd keeps for backward, each storage counted once
            local = t.to_local() if isinstance(t, DTensor) else t
            try:
                storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
            except RuntimeError:  # a tensor without its own storage (a wrapper subclass): count its size
                storages[id(t)] = local.numel() * local.element_size()
            return t

        try:
            if measure:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    return super().forward_one_chunk(*args, **kwargs)
            return super().forward_one_chunk(*args, **kwargs)
        finally:
            self.busy_s += time.perf_counter() - start
            if torch.is_grad_enabled():
                self.max_in_flight = max(self.max_in_flight, len(self.fwd_cache))
            if measure:
                self.activation_bytes = sum(storages.values())

    def backward_one_chunk(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return super().backward_one_chunk(*args, **kwargs)
        finally:
            self.busy_s += time.perf_counter() - start

    def backward_weight_one_chunk(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return super().backward_weight_one_chunk(*args, **kwargs)
        finally:
            self.busy_s += time.perf_counter() - start


def build_schedule(chunks: list[PipelineChunk], layout: Layout, schedule: str, n_microbatches: int, loss_fn, device):
    """One PipelineStage per chunk and the schedule that runs them. `scale_grads=False`: the loss
    function already divides by the global batch's target count (docs/troubleshooting.md,
    "Pipeline loss scaled by the number of micro-batches")."""
    mine = stages_of_rank(layout.pp_rank, layout.pp, len(chunks))
    n_stages = layout.pp * len(chunks)
    stages = [
        TimedStage(chunk, stage_index=s, num_stages=n_stages, device=device, group=layout.group("pp"))
        for chunk, s in zip(chunks, mine, strict=True)
    ]
    for stage in stages:
        stage.reset_counters()
    if schedule in MULTI_STAGE_SCHEDULES:
        cls = (
            schedules.ScheduleInterleaved1F1B
            if schedule == "interleaved_1f1b"
            else schedules.ScheduleInterleavedZeroBubble
        )
        return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False), stages
    cls = schedules.ScheduleGPipe if schedule == "gpipe" else schedules.Schedule1F1B
    return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False), stages


def bubble_theory(pp: int, n_microbatches: int, stages_per_rank: int = 1) -> float:
    """Idle fraction of GPipe/1F1B: (p-1)/(m+p-1); interleaving v stages per rank divides the
    bubble's length by v: (p-1)/(v*m+p-1)."""
    return (pp - 1) / (stages_per_rank * n_microbatches + pp - 1)


class PipelineStep:
    """The step under pipeline parallelism: the schedule runs forward and backward of all
    micro-batches through the stages. The last stage computes the loss of each micro-batch,
    already divided by the global target count; the other stages return zero, and the logged
    loss is summed from the last stage's ranks."""

    def __init__(
        self, accelerator, layout: Layout, chunks, schedule: str, n_microbatches: int, use_loss_parallel: bool = False
    ):
        self.accelerator, self.layout, self.use_loss_parallel = accelerator, layout, use_loss_parallel
        self.schedule, self.stages = build_schedule(
            chunks, layout, schedule, n_microbatches, self.loss_fn, accelerator.device
        )
        self.has_first = any(stage.is_first for stage in self.stages)
        self.has_last = any(stage.is_last for stage in self.stages)
        self.scale = 1.0
        self.busy_s = self.step_s = 0.0
        self.max_in_flight, self.steps = 0, 0

    def loss_fn(self, logits, labels):
        loss_sum, _ = cross_entropy_sum(logits, labels)
        return loss_sum * self.scale

    def _context(self):
        return loss_parallel() if self.use_loss_parallel else nullcontext()

    def __call__(self, window: list, global_targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of the whole batch; returns this replica's loss sum."""
        (mb,) = window  # the schedule splits the batch into micro-batches itself
        self.scale = self.layout.dp / global_targets  # times dp: FSDP averages gradients over the dp ranks
        for stage in self.stages:
            stage.reset_counters()
        inputs = (mb["input_ids"],) if self.has_first else ()
        target = mb["labels"] if self.has_last else None
        losses = []  # the last stage's loss per micro-batch, as loss_fn returned it
        start = time.perf_counter()
        with self.accelerator.autocast(), self._context():  # Accelerate: autocast
            self.schedule.step(*inputs, target=target, losses=losses)  # PP: the whole schedule, forward and backward
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
        with self._context():
            logits = self.schedule.eval(
                *((input_ids,) if self.has_first else ()), target=input_ids if self.has_last else None
            )
        return logits if self.has_last else None

    def summary(self, args) -> dict:
        """Per stage (pipeline rank): measured bubble, micro-batches in flight, activation memory;
        beside the theory. Collective (a gather)."""
        busy = self.busy_s / self.step_s if self.step_s else -1.0
        act = max((stage.activation_bytes or 0) for stage in self.stages)
        row = torch.tensor(
            [self.layout.pp_rank, busy, self.max_in_flight, act, act * self.max_in_flight],
            dtype=torch.float64,
            device=self.accelerator.device,
        )
        rows = self.accelerator.gather(row[None]).cpu()  # Accelerate: all-gather
        per_stage = {int(r[0]): r for r in rows}  # one rank of each pipeline position (its replicas agree up to timing)
        ranks = sorted(per_stage)
        return {
            "pipeline_schedule": args.schedule,
            "n_microbatches": args.n_microbatches,
            "stages_per_rank": args.stages_per_rank,
            "bubble_theory": round(bubble_theory(self.layout.pp, args.n_microbatches, args.stages_per_rank), 4),
            "bubble_measured_per_rank": [
                None if per_stage[r][1] < 0 else round(1 - float(per_stage[r][1]), 4) for r in ranks
            ],
            "max_microbatches_in_flight_per_rank": [int(per_stage[r][2]) for r in ranks],
            "activation_mib_per_microbatch_per_rank": [round(float(per_stage[r][3]) / 2**20, 4) for r in ranks],
            "peak_activation_mib_per_rank": [round(float(per_stage[r][4]) / 2**20, 4) for r in ranks],
        }


def add_pipeline_args(parser):
    g = parser.add_argument_group("pipeline parallel")
    g.add_argument("--schedule", default="1f1b", help=f"pipeline schedule: {' | '.join(SCHEDULES)}")
    g.add_argument("--n_microbatches", type=int, default=4, help="micro-batches each --batch_size is split into")
    g.add_argument(
        "--stages_per_rank",
        type=int,
        help="stages each rank holds (default: 2 for interleaved_1f1b and zero_bubble, else 1)",
    )
    g.add_argument(
        "--split_points",
        help="comma-separated layer indices where a new stage begins, e.g. 1,3 (default: balance layers by count)",
    )
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
        raise UsageError(
            f"--stages_per_rank {args.stages_per_rank}: --schedule {args.schedule} runs one stage per rank; "
            "use interleaved_1f1b or zero_bubble, or drop --stages_per_rank"
        )
    if args.n_microbatches < 1:
        raise UsageError(f"--n_microbatches must be at least 1 (got {args.n_microbatches})")
    if args.split_points:
        try:
            args.split_points = [int(x) for x in str(args.split_points).split(",")]
        except ValueError:
            raise UsageError(
                f"--split_points {args.split_points!r}: give comma-separated layer indices, e.g. 1,3"
            ) from None
    else:
        args.split_points = None


def check_pipeline_flags(layout: Layout, n_layer: int, args) -> None:
    """Checks that need the layout and the model."""
    n_stages = layout.pp * args.stages_per_rank
    if args.batch_size % args.n_microbatches:
        raise UsageError(
            f"--batch_size {args.batch_size} cannot be split into --n_microbatches {args.n_microbatches} equal "
            "micro-batches: use a batch size divisible by it"
        )
    if args.gradient_accumulation_steps != 1:
        raise UsageError(
            "--gradient_accumulation_steps: the pipeline already accumulates over its micro-batches; raise "
            "--batch_size and --n_microbatches instead (and keep accumulation 1)"
        )
    if args.split_points is not None:
        points = args.split_points
        if len(points) != n_stages - 1 or points != sorted(set(points)) or points[0] <= 0 or points[-1] >= n_layer:
            raise UsageError(
                f"--split_points {','.join(map(str, points))}: {n_stages} stages need {n_stages - 1} increasing "
                f"layer indices between 1 and {n_layer - 1}"
            )
    if layout.pp > 1 and args.schedule != "gpipe" and args.n_microbatches < layout.pp:
        raise UsageError(
            f"--n_microbatches {args.n_microbatches} is fewer than the {layout.pp} pipeline ranks: --schedule "
            f"{args.schedule} needs at least one micro-batch per rank in flight (raise --n_microbatches, or use gpipe)"
        )
    if args.schedule in MULTI_STAGE_SCHEDULES and args.n_microbatches % layout.pp:
        raise UsageError(
            f"--n_microbatches {args.n_microbatches}: --schedule {args.schedule} needs a multiple of the "
            f"{layout.pp} pipeline ranks"
        )


def main():
    # ---------------------------------------- flags
    parser = build_parser(__doc__)
    g = add_pipeline_args(parser)
    g.add_argument("--pp_size", type=int, default=-1, help="pipeline stages (ranks per pipeline; -1: all processes)")
    args = parser.parse_args()
    args.output_dir = args.output_dir or "runs/pp"
    check_core_args(args)
    check_pipeline_args(args)
    model_config = model_config_from_args(args)

    # ---------------------------------------- Accelerator and layout
    # Accelerate: process group (gloo on CPU, NCCL on GPU), device, mixed precision from the launcher;
    # the scheduler counts optimizer steps, whatever the layout.
    accelerator = make_accelerator(args, sharded="train_pp", step_scheduler_with_optimizer=False)
    layout = Layout.from_degrees(
        accelerator.num_processes, pp=args.pp_size, dp_shard=1 if args.pp_size == -1 else -1
    )  # PP x the rest
    layout.check_model(model_config, args.stages_per_rank)  # at least one layer per stage
    check_pipeline_flags(layout, model_config.n_layer, args)
    global_batch_size = args.batch_size * layout.dp * args.gradient_accumulation_steps

    # ---------------------------------------- data (checked before anything is written)
    data = load_data(args, accelerator, model_config.block_size)
    train_loader = make_train_loader(data.train, args.batch_size, global_batch_size, args.seed)
    resume_path = check_resume_and_output(accelerator, args, model_config, global_batch_size)
    layout.build_mesh(accelerator.device.type)

    # ---------------------------------------- model
    set_seed(
        args.seed
    )  # Accelerate: the same full model on every rank before it is cut: init independent of the layout
    model = GPT(model_config).to(accelerator.device)
    n_params = count_parameters(model)

    # ---------------------------------------- PP: the strategy
    stages = split_pipeline(
        model, layout, args.stages_per_rank, args.split_points
    )  # PP: keep this rank's layers, one view per stage
    if args.compile:
        compile_blocks(model, accelerator)  # this rank's blocks, before FSDP
    if layout.dp > 1:  # processes beyond one pipeline: data parallel over the pipelines (FSDP per stage)
        # several forwards run before their backwards: keep the weights gathered for the whole step,
        # one all-gather per block instead of one per micro-batch (torchtitan's default under PP)
        apply_fsdp(model, stages, layout.fsdp_mesh, accelerator.mixed_precision, reshard_after_forward=False)
    pipeline = PipelineStep(
        accelerator, layout, stages, args.schedule, args.n_microbatches
    )  # PP: PipelineStage + schedule

    # ---------------------------------------- optimizer (after the split: this rank's layers)
    optimizer = make_optimizer(model, args)
    scheduler = make_scheduler(optimizer, args)
    # Accelerate: optimizer/scheduler wrappers (not the model: the pipeline owns it);
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
    log = RunLog(accelerator, args, "train_pp", step, layout.world_size, global_batch_size)
    n_stages = layout.pp * args.stages_per_rank
    layers = stage_layers(model_config.n_layer, n_stages, args.split_points)
    stage_list = ", ".join(f"{s}: layers {r.start}-{r.stop - 1}" for s, r in enumerate(layers))
    bubble = bubble_theory(layout.pp, args.n_microbatches, args.stages_per_rank)
    pipeline_line = (
        f"pipeline: {n_stages} stages ({stage_list}), schedule {args.schedule}, "
        f"{args.n_microbatches} micro-batches of {args.batch_size // args.n_microbatches}"
    )
    bubble_line = f"bubble in theory: (p-1)/(v*m+p-1) = {bubble:.3f}; measured in the summary"
    costs = sharded_start_lines(model, layout, n_params, args.optimizer, accelerator)
    log.start(model_config, n_params, data, [pipeline_line, bubble_line, costs], resume_path, layout)
    state_bytes, comm = {}, {}  # measured on the first step
    model.train()
    while step < min(args.max_steps, args.stop_at_step or args.max_steps) and not stream.preempted:
        log.step_start()
        window, global_targets = stream.next_step()
        # the first step's collectives are counted (not under --compile: a dispatch mode stops it)
        with CollectiveCounter(enabled=step == start_step and not args.compile) as counter:
            loss_sum = pipeline(
                window, global_targets
            )  # PP: every micro-batch through every stage, forward and backward
        # summed over the stages
        grad_norm = clip_grad_norm_(model.parameters(), args.max_grad_norm, layout.group("pp"))
        lr = scheduler.get_last_lr()[0]
        optimizer.step()  # PP: each rank updates its own layers
        scheduler.step()
        if step == start_step:
            state_bytes, comm = training_state_bytes(model, optimizer), counter.report()
            log.write(first_step_line(state_bytes, comm))
        optimizer.zero_grad(set_to_none=True)
        step += 1
        log.step_end()

        if log.is_log_step(step):
            # the last stage holds the loss sum: one of its ranks per data-parallel replica counts it
            loss_sum = loss_sum if layout.holds_loss else torch.zeros_like(loss_sum)
            loss = (accelerator.reduce(loss_sum, reduction="sum") / global_targets).item()  # Accelerate: all-reduce
            log.train(step, loss, lr, grad_norm, epoch=stream.epoch)
        if log.is_eval_step(step):
            model.eval()  # through the pipeline, with the training batch's shape
            result = evaluate_sharded(
                accelerator, pipeline.predict, data.validation, args.batch_size, layout, data.task
            )
            model.train()
            log.eval(step, result)
        if log.is_checkpoint_step(step) or stream.preempted:  # preempted: every rank saves
            state = trainer_state(step, stream, args, model_config, global_batch_size, layout.world_size, layout)
            # every rank writes its part (a collective)
            save_checkpoint(accelerator, model, optimizer, scheduler, state, args.output_dir, args.keep_last)
    stream.close()

    # ---------------------------------------- save
    if step == args.max_steps:  # every rank: one rank per stage sends its layers to the main process
        export_model(accelerator, model, model_config, data_source(args), Path(args.output_dir) / "model", layout)
    costs = sharded_summary(accelerator, layout, n_params, args.optimizer, state_bytes, comm)
    log.summary(step, preempted=stream.preempted, **costs, **pipeline.summary(args))
    accelerator.wait_for_everyone()
    accelerator.end_training()  # Accelerate: closes trackers, destroys the process group


if __name__ == "__main__":
    run_main(main)
