#!/usr/bin/env python
"""Pipeline parallelism with torch.distributed.pipelining, under 🤗 Accelerate.

The model is cut between its repeated units (blocks, decoder layers) into stages, one per rank
(embeddings with the first units, final norm and head with the last). Activations flow forward
from stage to stage and gradients flow back. To keep every stage busy, each batch is split into
micro-batches that follow each other through the pipe; the schedule decides the order:

    GPipe, 4 stages, 4 micro-batches (F = forward, B = backward, . = idle: the bubble)
    stage 0: F0 F1 F2 F3 .  .  .  .  .  .  B3 B2 B1 B0
    stage 1: .  F0 F1 F2 F3 .  .  .  .  B3 B2 B1 B0 .
    stage 2: .  .  F0 F1 F2 F3 .  .  B3 B2 B1 B0 .  .
    stage 3: .  .  .  F0 F1 F2 F3 B3 B2 B1 B0 .  .  .    each holds 4 micro-batches' activations

    1F1B: same bubble, but each stage starts backward as soon as it can, so it holds at most
    (stages - its index) micro-batches' activations instead of all of them
    stage 0: F0 F1 F2 F3 .  .  .  B0 .  B1 .  B2 .  B3
    stage 3: .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .  .

    bubble (idle fraction) of both: (p - 1) / (m + p - 1) for p stages and m micro-batches.
    interleaved 1F1B (--stages_per_rank 2): each rank holds 2 smaller stages, bubble / 2.
    zero bubble: backward split into input-gradient and weight-gradient parts; the weight parts
    fill the bubble.

Run it:
    accelerate launch --config_file accelerate_configs/cpu_multi.yaml scripts/train_pp.py \\
        --schedule 1f1b
    accelerate launch ... --num_processes 4 scripts/train_pp.py \\
        --n_layer 8 --schedule interleaved_1f1b --n_microbatches 8
--batch_size is the batch the schedule splits into --n_microbatches (use it instead of gradient
accumulation); evaluation runs through the pipeline with the same batch shape. Every process is one
pipeline rank; pipelines trained data parallel (dp x pp) are train_hybrid.py's.
Lines marked `# Accelerate:` are the library's part; the rest is plain PyTorch.
`# PP:` marks the strategy, which knows the model only through its Task; it builds torch's
PipelineStage and schedule itself (PipelineStep). Below it, in common/: the stage split and the
flags' parsing (pipeline.py), a 🤗 model's stages (hf_pp.py), the refusals (pp_checks.py), what the
schedule costs, in theory and measured (pp_costs.py).
"""

import sys
from contextlib import nullcontext
from pathlib import Path

# scripts run as files: copy common/ beside this file
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.nn as nn
from accelerate.utils import set_seed
from torch.distributed.pipelining import PipelineStage, schedules
from torch.distributed.tensor import DTensor

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
from common.pipeline import parse_pipeline_flags, stage_layers, stages_of_rank
from common.pp_checks import check_pipeline_layout, check_pp_size, check_stage_parameters, check_stages_compute
from common.pp_costs import ScheduleMeter, pipeline_start_lines
from common.sharded import clip_grad_norm_, shard_loader
from common.sharded_costs import sharded_start_line, sharded_summary
from common.training import StepFeed, compile_units, make_optimizer, make_scheduler, unit_modules


# ======================================== MODEL: how one pipeline stage runs (docs/your-model.md)
def stage_modules(model: nn.Module, stages: list[tuple[range, bool, bool]]) -> list[nn.Module]:
    """This rank's stages, one module per (units, is_first, is_last); the parts only the first stage
    uses (embeddings) go where this rank holds no first stage, those of the last (final norm, head)
    where it holds no last. The built-in GPT's stage is a view of some of its blocks (GPTStage); a
    model of your own: write its stages here (docs/pp.md, "A model of your own")."""
    from common.model import GPT, GPTStage

    if hasattr(getattr(model, "config", None), "base_model_pp_plan"):  # a 🤗 model: its own plan
        from common.hf_pp import hf_stage_modules  # the 🤗 stages: imported only for a 🤗 model

        return hf_stage_modules(model, stages)
    if not isinstance(model, GPT):
        raise UsageError(
            f"no pipeline stages for {type(model).__name__} yet: write them in train_pp.py's MODEL "
            'section, stage_modules: one module per stage (docs/pp.md, "A model of your own")'
        )
    if not any(first for _, first, _ in stages):
        model.tok_emb = model.pos_emb = None
    if not any(last for _, _, last in stages):
        model.ln_f = model.lm_head = None
    return [GPTStage(model, units, first, last) for units, first, last in stages]


# ======================================== PP: the strategy
def split_pipeline(model, units, layout, build_stages, stages_per_rank=1, split_points=None):
    """Cut the repeated `units` (ModuleDict, ModuleList or Sequential) into pp x stages_per_rank
    stages; keep this rank's. The others are deleted, or nn.Identity() in a list (the rest keep
    their indices): every parameter keeps its full-model name, so checkpoints move between layouts.
    `build_stages` (the MODEL section's stage_modules): one module per stage this rank holds."""
    n_stages = layout.pp * stages_per_rank
    ranges = stage_layers(len(units), n_stages, split_points)
    mine = stages_of_rank(layout.pp_rank, layout.pp, stages_per_rank)
    check_stages_compute(model, ranges, stage_modules)  # a 🤗 model's stages, chained, are the model
    keep = {i for s in mine for i in ranges[s]}
    names = list(units.keys()) if isinstance(units, nn.ModuleDict) else list(range(len(units)))
    others = {i: units[name] for i, name in enumerate(names) if i not in keep}  # other ranks' units
    for i, name in enumerate(names):
        if i in keep:
            continue
        if isinstance(units, nn.ModuleDict):
            del units[name]
        else:
            units[i] = nn.Identity()  # no parameters; the rest keep their indices
    modules = build_stages(model, [(ranges[s], s == 0, s == n_stages - 1) for s in mine])
    check_stage_parameters(model, modules, others)  # the rank keeps nothing it does not train
    return modules


class PipelineStep:
    """The pipeline's step: torch's PipelineStage around each stage module (`chunks`) this rank
    holds (it receives the stage's inputs from the stage before and sends its outputs on), and the
    schedule that runs every micro-batch forward and backward through them. The first stage gets
    Task.inputs, the last Task.targets and scores each micro-batch (Task.loss over the global target
    count, so scale_grads=False: docs/troubleshooting.md); the rank that holds the loss
    (Layout.holds_loss) reports its sum. Its meter times the stages (the measured bubble)."""

    loss_context = staticmethod(nullcontext)  # the context the loss is computed in

    def __init__(self, accelerator, layout, task, chunks, schedule, n_microbatches):
        self.accelerator, self.layout, self.task = accelerator, layout, task
        n_stages = layout.pp * len(chunks)  # pp ranks x the stages each holds
        mine = stages_of_rank(layout.pp_rank, layout.pp, len(chunks))  # rank r: r, r + pp, ...
        self.stages = [  # PP: the module, its place in the pipeline, its peers (the pp group)
            PipelineStage(chunk, s, n_stages, accelerator.device, group=layout.group("pp"))
            for chunk, s in zip(chunks, mine, strict=True)
        ]
        cls = {
            "gpipe": schedules.ScheduleGPipe,
            "1f1b": schedules.Schedule1F1B,
            "interleaved_1f1b": schedules.ScheduleInterleaved1F1B,  # several stages per rank
            "zero_bubble": schedules.ScheduleInterleavedZeroBubble,  # several stages per rank
        }[schedule]
        runs = self.stages if issubclass(cls, schedules.PipelineScheduleMulti) else self.stages[0]
        self.schedule = cls(runs, n_microbatches, loss_fn=self.loss_fn, scale_grads=False)
        self.has_first = any(stage.is_first for stage in self.stages)
        self.has_last = any(stage.is_last for stage in self.stages)
        self.scale, self.scoring = 1.0, True
        self.meter = ScheduleMeter(self.stages, accelerator, layout)  # common/pp_costs.py

    def loss_fn(self, outputs, targets):
        if not self.scoring:  # predict(): forward only, the outputs are what is wanted
            return torch.zeros((), device=self.accelerator.device)
        loss_sum, _ = self.task.loss(outputs, targets)
        return loss_sum * self.scale

    def __call__(self, micro_batches: list, n_global_targets: torch.Tensor) -> torch.Tensor:
        """One pipeline step: the first stage takes the batch, the schedule cuts it into
        micro-batches and runs each forward through every stage and backward again, each stage
        summing its gradients; the last stage scores them. Returns this replica's loss sum where it
        is reported."""
        (mb,) = micro_batches  # the schedule splits the batch into micro-batches itself
        self.scale = self.layout.dp / n_global_targets  # times dp: FSDP averages over the dp ranks
        inputs = tuple(x for x in self.task.inputs(mb) if x is not None) if self.has_first else ()
        target = self.task.targets(mb) if self.has_last else None
        losses = []  # the last stage's loss per micro-batch, as loss_fn returned it
        with self.meter.timed(), self.accelerator.autocast(), self.loss_context():
            self.schedule.step(*inputs, target=target, losses=losses)  # PP: forward and backward
        if not losses or not self.layout.holds_loss:
            return torch.zeros((), device=self.accelerator.device)
        losses = [loss.full_tensor() if isinstance(loss, DTensor) else loss for loss in losses]
        return torch.stack(losses).sum().detach() / self.scale  # back to this replica's loss sum

    def predict(self, *inputs):
        """Forward only (evaluate's `predict`): the last stage gets the whole batch's outputs,
        the others None. loss_fn scores nothing; the first input stands in for the targets."""
        target = inputs[0] if self.has_last else None
        inputs = tuple(x for x in inputs if x is not None) if self.has_first else ()  # no None mask
        self.scoring = False
        try:
            with self.loss_context():
                outputs = self.schedule.eval(*inputs, target=target)  # PP: forward only
        finally:
            self.scoring = True
        return outputs if self.has_last else None


def add_pipeline_args(parser):
    """The pipeline's flags (train_hybrid.py's too); common/pipeline.py parses them."""
    g = parser.add_argument_group("pipeline parallel")
    schedule_help = "pipeline schedule: gpipe | 1f1b | interleaved_1f1b | zero_bubble"
    g.add_argument("--schedule", default="1f1b", help=schedule_help)
    g.add_argument("--n_microbatches", type=int, default=4, help="micro-batches per --batch_size")
    stages_help = "stages each rank holds (default: 2 for interleaved_1f1b and zero_bubble, else 1)"
    g.add_argument("--stages_per_rank", type=int, help=stages_help)
    split_help = "comma-separated unit (layer) indices where a new stage begins, e.g. 1,3 "
    g.add_argument("--split_points", help=split_help + "(default: balance the units by count)")
    return g


def main():
    # ---------------------------------------- flags
    parser = build_parser(__doc__)
    from common.builtin_flags import add_builtin_flags  # the built-in data sets' and models' flags

    add_builtin_flags(parser)  # data and a model of your own: drop these two lines
    g = add_pipeline_args(parser)  # PP: --schedule, --n_microbatches ... (above)
    pp_help = "pipeline ranks: every process (-1, or their number); dp x pp is train_hybrid.py's"
    g.add_argument("--pp_size", type=int, default=-1, help=pp_help)
    args = parser.parse_args()
    args.output_dir = args.output_dir or "runs/pp"
    check_core_args(args)
    parse_pipeline_flags(args)  # PP: checked before any process group exists

    # ---------------------------------------- Accelerator and layout
    # Accelerate: process group (gloo on CPU, NCCL on GPU), device, mixed precision (launcher).
    # cpu=True where CUDA is missing: the N processes then join one gloo group (else each
    # trains alone). The scheduler counts optimizer steps, whatever the layout.
    accelerator = make_accelerator(
        args,
        cpu=args.cpu or not torch.cuda.is_available(),
        sharded=True,  # PP owns the model: refuses a launch that also asks Accelerate to shard it
        step_scheduler_with_optimizer=False,
    )
    record_peers(accelerator)  # guard: peer records
    check_pp_size(args.pp_size, accelerator.num_processes)  # PP: dp x pp is train_hybrid.py's
    layout = Layout.from_degrees(accelerator.num_processes, pp=-1, dp_shard=1)  # PP: a stage each
    dp_size = layout.dp  # PP: 1, one pipeline: every stage reads the same batch
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

    model, task = language_model(args, data)
    model = model.to(accelerator.device)
    units = task.units(model)  # the repeated units: the pipeline cuts between them
    check_pipeline_layout(layout, len(units), args, type(unit_modules(units)[0]).__name__)
    pp_lines = pipeline_start_lines(layout, len(units), args)  # PP: stages, bubble (all units)
    n_params, model_line = count_parameters(model), task.describe(model)
    resume_path, facts = start_point(accelerator, args, model, task, global_batch_size, layout)
    check_resume_and_output(accelerator, args, resume_path, facts)  # guard: output lock
    check_task_contract(task, model, data.validation, accelerator.device)  # guard: contract
    reference = uncut_copy(model, task, args.skip_cut_check)  # guard: cut check

    # ---------------------------------------- PP: the strategy, before the optimizer
    layout.build_mesh(accelerator.device.type)
    # keep this rank's units and one module per stage it holds (its embeddings, its norm and head)
    stages = split_pipeline(model, units, layout, stage_modules, args.stages_per_rank, args.split_points)
    if args.compile:
        compile_units(units, accelerator)  # this rank's units
    pipeline = PipelineStep(accelerator, layout, task, stages, args.schedule, args.n_microbatches)

    # ---------------------------------------- optimizer
    optimizer = make_optimizer(model, args)
    scheduler = make_scheduler(optimizer, args)
    train_sampler = train_loader.sampler
    # Accelerate: optimizer and scheduler wrappers (not the model: PP owns it)
    optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
    train_loader = shard_loader(train_loader, accelerator, layout)
    probe_step = pipeline  # PP: the schedule, on a probe
    probe_step.micro_batch_size = args.batch_size  # PP: the shapes its stages send each other
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
    monitor = RunMonitor(accelerator, args, "train_pp", feed, layout.world_size, global_batch_size)
    costs = sharded_start_line(model, layout, n_params, args.optimizer, accelerator)
    monitor.start(task, model_line, n_params, data, [*pp_lines, costs], resume_path, layout)
    pp_group = layout.group("pp")  # PP: the gradient norm sums over the stages

    # ---------------------------------------- the training loop
    step, last_step = progress["step"], min(args.max_steps, args.stop_at_step or args.max_steps)
    model.train()
    while step < last_step and not feed.preempted:
        with monitor.timed_step():  # training time (not the records, evaluations, checkpoints)
            micro_batches, n_global_targets = feed.next_step()
            # PP: all micro-batches through all stages, forward and backward
            with monitor.collectives():
                loss_sum = pipeline(micro_batches, n_global_targets)
            grad_norm = clip_grad_norm_(model.parameters(), args.max_grad_norm, pp_group)
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
            scores = evaluate(  # PP: forward only, through the pipeline
                accelerator, model, task, data.validation, args.batch_size, layout, predict=pipeline.predict
            )
            monitor.eval(step, scores)
        if monitor.due(step, "checkpoint") or feed.preempted:  # every rank writes its part
            save_checkpoint(accelerator, args, step, feed, model, optimizer, scheduler, facts)
    feed.close()

    # ---------------------------------------- save
    if step == args.max_steps:  # every rank gathers what it holds; the main process writes
        export_model(accelerator, model, task, data_source(args), Path(args.output_dir) / "model", layout)
    costs = sharded_summary(accelerator, layout, n_params, args.optimizer, model, optimizer)
    monitor.summary(step, preempted=feed.preempted, **costs, **pipeline.meter.summary(args))
    accelerator.wait_for_everyone()
    accelerator.end_training()  # Accelerate: closes trackers and destroys the process group


if __name__ == "__main__":
    run_main(main)
