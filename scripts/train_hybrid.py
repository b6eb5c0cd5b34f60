#!/usr/bin/env python
"""Hybrid parallelism on one device mesh: pipeline x data (FSDP/HSDP) x tensor parallel.

How GPT-3-class models are trained: every strategy splits along its own mesh dimension, and
they compose because each one talks only inside its own groups:

    8 ranks: --pp_size 2 --dp_shard 2 --tp_size 2            tp groups:  {0,1} {2,3} {4,5} {6,7}
                      dp_shard 0        dp_shard 1           dp groups:  {0,2} {1,3} {4,6} {5,7}
        pp stage 0:  [ rank 0 | 1 ]    [ rank 2 | 3 ]        pp groups:  {0,4} {1,5} {2,6} {3,7}
        pp stage 1:  [ rank 4 | 5 ]    [ rank 6 | 7 ]
                      └ tp ┘
    - pp: stage 0 holds units 0..L/2-1 and the embeddings, stage 1 the rest and the head;
      activations go 0 -> 1, gradients 1 -> 0 (send/recv between pp peers)
    - tp: inside [ | ], each weight matrix is split in two (all-reduces in the pair, every layer)
    - dp: the two columns train on different halves of the batch; FSDP shards each stage's
      (already TP-split) weights between them (all-gather / reduce-scatter per unit)
    - dp_replicate x dp_shard = HSDP: shard inside a group, replicate across groups

Choosing a layout: TP inside a node (it talks every layer), PP across nodes (it sends only
activations, once per stage boundary), FSDP/DP over the rest.

Run it:
    accelerate launch --config_file accelerate_configs/cpu_multi.yaml --num_processes 4 \\
        scripts/train_hybrid.py --dp_shard 2 --tp_size 2
    accelerate launch ... --num_processes 8 scripts/train_hybrid.py \\
        --n_layer 4 --pp_size 2 --dp_shard 2 --tp_size 2
    accelerate launch ... --num_processes 4 scripts/train_hybrid.py \\
        --model_config llama --dp_shard 2 --tp_size 2
    accelerate launch ... --num_processes 2 scripts/train_hybrid.py \\
        --tp_size 1 --dp_shard 2   # FSDP, no TP split
Strategies are applied in a fixed order (split into stages, then TP, then activation checkpointing,
then --compile, then FSDP), by the functions imported from train_pp.py, train_tp.py, train_cp.py and
train_fsdp.py: this file holds the mesh, the order and its own step (TP beside FSDP). The MODEL
section names the model (the built-in GPT, or a 🤗 transformers model: --model_config llama above);
its TP plan and pipeline stages are those of train_tp.py's and train_pp.py's MODEL sections.
A checkpoint saved by any script and layout resumes under any other (same model, same global batch).
"""

import sys
import warnings
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path

# scripts run as files: copy common/ beside this file
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from accelerate.utils import set_seed
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from train_cp import apply_context_parallel

from common.checkpoint import export_model, load_checkpoint, save_checkpoint, start_point
from common.cli import batch_of_step, build_parser, check_core_args, data_source
from common.context_parallel import cp_loss, plain_attention, whole_sequence_predict
from common.contract_check import check_task_contract
from common.costs import count_parameters
from common.cp_checks import check_cp
from common.cut_check import check_cut, uncut_copy
from common.errors import UsageError
from common.evaluation import evaluate
from common.launch import make_accelerator, record_peers, run_main
from common.layout import Layout
from common.loader import make_train_loader
from common.metrics import RunMonitor
from common.output_checks import check_resume_and_output, trial_checkpoint
from common.pipeline import parse_pipeline_flags
from common.pp_checks import check_pipeline_layout
from common.sharded import clip_grad_norm_, shard_loader
from common.sharded_costs import sharded_start_line, sharded_summary
from common.tp_checks import check_plan_forward, check_tp_flags, check_tp_plan
from common.training import StepFeed, compile_units, make_optimizer, make_scheduler, unit_modules
from train_fsdp import apply_activation_checkpointing, apply_fsdp
from train_pp import PipelineStep, add_pipeline_args, split_pipeline, stage_modules
from train_tp import apply_tensor_parallel, model_tp_plan


# ======================================== MODEL: its TP plan and pipeline stages (docs/your-model.md)
# The TP plan is train_tp.py's (model_tp_plan: the GPT's, or a 🤗 model's from its family's plan);
# the pipeline stages are train_pp.py's (stage_modules), with the one thing TP adds here:
def tp_stage_modules(model, stages: list, sp_mesh=None) -> list:
    """train_pp.py's stages of the model (split_pipeline's builder). Under TP with
    --sequence_parallel (`sp_mesh`: the TP mesh) the activations between blocks are cut over the
    sequence, and each rank sends the next stage its slice, a plain tensor. The GPT's blocks take
    the slice as it comes (its plan's local outputs); a 🤗 model's stage gets it wrapped again as a
    Shard(1) DTensor (SequenceSliceStage), since 🤗 reads the positions, rotary cos/sin and masks off
    the length of what it is given: the whole sequence."""
    from common.model import GPT

    modules = stage_modules(model, stages)
    if sp_mesh is None or isinstance(model, GPT):
        return modules
    return [SequenceSliceStage(m, sp_mesh, first, last) for m, (_, first, last) in zip(modules, stages, strict=True)]


class SequenceSliceStage(torch.nn.Module):
    """A 🤗 pipeline stage under sequence parallel: what crosses stages is this rank's sequence
    slice, a plain tensor; it enters as a Shard(1) DTensor of the whole sequence and leaves as the
    local slice again."""

    def __init__(self, stage, sp_mesh, is_first: bool, is_last: bool):
        super().__init__()
        self.stage, self.sp_mesh, self.is_first, self.is_last = stage, sp_mesh, is_first, is_last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Shard

        if not self.is_first:  # TP: hidden states, this rank's slice of the sequence
            x = DTensor.from_local(x, self.sp_mesh, [Shard(1)], run_check=False)
        x = self.stage(x)
        if not self.is_last and isinstance(x, DTensor):
            x = x.to_local()  # TP: only plain tensors cross stages
        return x


# ======================================== the strategies, in torchtitan's order
def apply_strategies(model, task, units: list, layout: Layout, args, plan: dict, accelerator):
    """PP split -> TP -> CP -> activation checkpointing -> compile -> FSDP, each by its lesson's
    apply function, each along its own mesh dimension. Returns this rank's pipeline stages (None
    without PP) and the CP attention (None without CP)."""
    stages = None
    if layout.pp > 1:  # PP: 1. keep this rank's units, one module per stage it holds
        # TP: activations cut over the sequence
        sp_mesh = layout.sub("tp") if args.sequence_parallel else None
        build = partial(tp_stage_modules, sp_mesh=sp_mesh)  # the MODEL section's (above)
        stages = split_pipeline(model, units, layout, build, args.stages_per_rank, args.split_points)
        # TP: the plan again, of what this rank holds (the MODEL section skips dropped parts)
        if layout.tp > 1:
            plan = model_tp_plan(model, task, layout, args.sequence_parallel, args.loss_parallel)
    if layout.tp > 1:
        # TP: 2. every weight the plan names becomes a shard
        apply_tensor_parallel(model, layout.sub("tp"), plan)
    # CP: 3. the ring attention
    attention = apply_context_parallel(model, task, layout) if layout.cp > 1 else None
    if args.activation_checkpointing:
        apply_activation_checkpointing(units)  # 4. recompute each unit's activations in backward
    if args.compile:
        compile_units(units, accelerator)  # 5. torch.compile per unit, before FSDP's hooks
    # FSDP: 6. one unit per repeated unit, then each root; 2-D: HSDP; over dp x cp
    if layout.dp * layout.cp > 1:
        # under PP the units stay gathered for the whole step: one all-gather, not one per
        # micro-batch; under TP the logits are a view of a DTensor's local tensor, which FSDP warns
        # about (the loss only reads them)
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        apply_fsdp(units, stages or [model], layout.fsdp_mesh, accelerator.mixed_precision, layout.pp == 1)
    return stages, attention


def check_layout_fits(model, task, units: list, layout: Layout, args, plan: dict) -> None:
    """Before any cut, one line each: the TP plan fits the model and the flags; CP's sequence (2 x
    cp divides it; not beside PP or SP); a unit per pipeline stage."""
    check_tp_plan(model, plan, args.sequence_parallel, args.loss_parallel)
    check_tp_flags(layout, task, args.sequence_parallel, args.loss_parallel)
    check_cp(layout, model, task, args)
    if layout.pp > 1:
        check_pipeline_layout(layout, len(units), args, type(unit_modules(units)[0]).__name__)


def order_line(layout: Layout, args) -> str:
    """The start line that names the strategies applied, in their order."""
    applied = (
        ("pipeline split", layout.pp > 1),
        ("tensor parallel", layout.tp > 1),
        ("context parallel", layout.cp > 1),
        ("activation checkpointing", args.activation_checkpointing),
        ("torch.compile", args.compile),
        ("HSDP" if layout.dp_replicate > 1 else "FSDP", layout.dp * layout.cp > 1),
    )
    return "order: " + (" -> ".join(name for name, on in applied if on) or "none (one process)")


# ======================================== the step: through the pipeline, or TP / CP beside FSDP
class LossParallelPipelineStep(PipelineStep):
    """train_pp.py's step with the loss on the last stage's vocabulary shards (TP's
    --loss_parallel)."""

    loss_context = staticmethod(loss_parallel)


def hybrid_step(accelerator, model, task, layout: Layout, args, stages, attention, unsharded: bool):
    """This layout's step, (micro_batches, n_global_targets) -> the loss sum this rank counts, and
    how evaluation predicts: (step, predict, eval batch size, the PipelineStep or None)."""
    # PP: the schedule runs every micro-batch through the stages, forward and backward
    if layout.pp > 1:
        step_class = LossParallelPipelineStep if args.loss_parallel else PipelineStep
        pipeline = step_class(accelerator, layout, task, stages, args.schedule, args.n_microbatches)
        return pipeline, pipeline.predict, args.batch_size, pipeline
    # TP and CP beside FSDP: one rank per replica counts the loss (TP rank 0, CP rank 0)
    step = partial(sharded_forward_backward, accelerator, model, counts_loss=layout.holds_loss)
    step.keywords.update(unsharded_accumulation=unsharded)
    if layout.cp > 1:  # CP: each rank's slice of every sequence; evaluation whole
        # FSDP averages the gradients over dp x cp ranks: the step scales back
        step.keywords.update(loss_of=cp_loss(task, layout, accelerator.device), grad_scale=layout.dp * layout.cp)
        return step, whole_sequence_predict(model, task, attention, layout), args.eval_batch_size, None
    step.keywords.update(loss_of=tp_loss(task, args.loss_parallel), grad_scale=layout.dp)
    return step, None, args.eval_batch_size, None


def sharded_forward_backward(
    accelerator,
    model,
    micro_batches: list,
    n_global_targets,
    loss_of,
    grad_scale: int,
    counts_loss: bool,
    unsharded_accumulation: bool,
) -> torch.Tensor:
    """train_tp.py's and train_cp.py's step beside FSDP: `loss_of(model, mb)` is the context the
    loss of a micro-batch is computed and back-propagated in (TP: on vocabulary shards; CP: this
    rank's tokens); the loss is scaled by `grad_scale` (dp, or dp x cp), as FSDP averages the
    gradients over those ranks; `unsharded_accumulation` holds the whole gradients through the
    micro-batches and reduce-scatters once, at the last (else FSDP reduce-scatters after each
    micro-batch). One rank per replica counts the loss."""
    step_loss_sum = torch.zeros((), device=accelerator.device)
    for i, mb in enumerate(micro_batches):
        # one reduce-scatter, at the last
        if unsharded_accumulation and isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(i == len(micro_batches) - 1)
        with accelerator.autocast(), loss_of(model, mb) as loss_sum:
            accelerator.backward(loss_sum * grad_scale / n_global_targets)  # Accelerate: backward
        step_loss_sum += loss_sum.detach().full_tensor() if isinstance(loss_sum, DTensor) else loss_sum.detach()
    return step_loss_sum if counts_loss else torch.zeros_like(step_loss_sum)


def tp_loss(task, use_loss_parallel: bool):
    """The loss of a micro-batch under TP, as a context (sharded_forward_backward's `loss_of`): on
    the vocabulary shards of the logits under --loss_parallel."""

    @contextmanager
    def loss_of(model, mb):
        with loss_parallel() if use_loss_parallel else nullcontext():
            yield task.loss_of(model, mb)[0]

    return loss_of


LAYOUT_FLAGS = "layout (the product must equal the number of processes; one may be -1: inferred)"
UNSHARDED_HELP = (
    "FSDP: keep whole unsharded gradients through the accumulation window and reduce-scatter once at its "
    "last micro-batch: less communication, more memory (default: a reduce-scatter every micro-batch)"
)


def add_layout_args(parser) -> None:
    """The mesh's degrees, TP's flags and the memory flags (the pipeline's: train_pp.py's)."""
    g = parser.add_argument_group(LAYOUT_FLAGS)
    g.add_argument("--pp_size", type=int, default=1, help="pipeline stages")
    g.add_argument("--dp_replicate", type=int, default=1, help="data-parallel replicas (HSDP: replicate across them)")
    g.add_argument("--dp_shard", type=int, default=-1, help="data-parallel ranks that shard the model (FSDP)")
    g.add_argument("--tp_size", type=int, default=1, help="ranks per tensor-parallel group (1: FSDP, no TP split)")
    g.add_argument(
        "--cp_size", type=int, default=1, help="context parallel: ranks that cut each sequence (train_cp.py)"
    )
    g = parser.add_argument_group("tensor parallel and memory")
    g.add_argument("--sequence_parallel", action="store_true", help="TP: shard norms/dropout along the sequence")
    g.add_argument("--loss_parallel", action="store_true", help="TP: cross-entropy on vocabulary-sharded logits")
    g.add_argument(
        "--activation_checkpointing", action="store_true", help="recompute each unit's activations in backward"
    )
    g.add_argument("--unsharded_accumulation", action="store_true", help=UNSHARDED_HELP)
    add_pipeline_args(parser)


def check_layout_flags(args) -> None:
    parse_pipeline_flags(args)
    if args.unsharded_accumulation and args.pp_size > 1:
        raise UsageError(
            "--unsharded_accumulation: under --pp_size the pipeline schedule reduces the gradients once per "
            "schedule step itself; drop it"
        )


def main():
    # ---------------------------------------- flags
    parser = build_parser(__doc__)
    from common.builtin_flags import add_builtin_flags  # the built-in data sets' and models' flags

    add_builtin_flags(parser)  # data and a model of your own: drop these two lines
    add_layout_args(parser)  # the mesh's degrees (pp, dp, tp, cp), TP's and the pipeline's flags
    args = parser.parse_args()
    args.output_dir = args.output_dir or "runs/hybrid"
    check_core_args(args)
    check_layout_flags(args)

    # ---------------------------------------- Accelerator and layout
    # Accelerate: process group (gloo on CPU, NCCL on GPU), device, mixed precision (launcher);
    # the scheduler counts optimizer steps, whatever the layout.
    accelerator = make_accelerator(args, sharded=True, step_scheduler_with_optimizer=False)
    record_peers(accelerator)  # guard: peer records
    degrees = {"dp_replicate": args.dp_replicate, "dp_shard": args.dp_shard, "tp": args.tp_size, "cp": args.cp_size}
    layout = Layout.from_degrees(accelerator.num_processes, pp=args.pp_size, **degrees)  # product: the world size
    grad_accum, global_batch_size = batch_of_step(args, layout.dp)  # batch_size x dp x accumulation

    # ---------------------------------------- data (checked before anything is written)
    # the built-in data sets (addition, pystdlib, hub, your files) in the model's context and tokens
    from common.data import load_data
    from common.model import context_length, tokenizer_for

    data = load_data(args, accelerator, context_length(args), tokenizer_for(args))
    train_loader = make_train_loader(data.train, args.batch_size, global_batch_size, args.seed)

    # ---------------------------------------- MODEL: the only lines that name the model
    set_seed(args.seed)  # Accelerate: one model on every rank, before any cut
    # the built-in GPT or a 🤗 causal LM (--model_name_or_path, --model_config), and its Task: a
    # micro-batch's (loss_sum, n_targets), its evaluation and export (docs/your-model.md)
    from common.model import language_model

    model, task = language_model(args, data)
    model = model.to(accelerator.device)
    # the repeated units: the pipeline split, TP's layers, checkpointing, --compile, FSDP units
    units = task.units(model)
    n_params, model_line = count_parameters(model), task.describe(model)
    # the TP plan, {module name: style}, of train_tp.py's MODEL section (the GPT's or a 🤗 model's)
    plan = model_tp_plan(model, task, layout, args.sequence_parallel, args.loss_parallel) if layout.tp > 1 else {}
    check_layout_fits(model, task, units, layout, args, plan)  # every cut, on the full model
    resume_path, facts = start_point(accelerator, args, model, task, global_batch_size, layout)
    check_resume_and_output(accelerator, args, resume_path, facts)  # guard: output lock
    reference = uncut_copy(model, task, args.skip_cut_check)  # guard: cut check
    layout.build_mesh(accelerator.device.type)

    # ---------------------------------------- the strategies, in torchtitan's order (above)
    stages, attention = apply_strategies(model, task, units, layout, args, plan, accelerator)
    unsharded = args.unsharded_accumulation and layout.dp * layout.cp > 1  # FSDP: whole gradients
    forward_backward, predict, eval_batch_size, pipeline = hybrid_step(
        accelerator, model, task, layout, args, stages, attention, unsharded
    )

    # ---------------------------------------- optimizer (after every cut: it sees the shards)
    optimizer = make_optimizer(model, args)
    scheduler = make_scheduler(optimizer, args)
    # Accelerate: optimizer/scheduler wrappers (not the model: each strategy owns it)
    optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
    train_sampler = train_loader.sampler
    train_loader = shard_loader(train_loader, accelerator, layout)  # over the dp ranks only
    if layout.pp == 1:  # a mean: refused (not under PP: no whole model)
        shards = (
            loss_parallel() if args.loss_parallel else plain_attention(task, model, attention) if attention else None
        )
        whole = plain_attention(task, model, attention) if attention else None  # CP: whole sequences
        check_plan_forward(model, plan, task, data.validation, accelerator.device, whole)  # TP: the cut runs
        check_task_contract(task, model, data.validation, accelerator.device, shards)  # guard: contract
    probe_step = forward_backward  # every cut, on a probe
    probe_step.micro_batch_size = args.batch_size if layout.pp > 1 else None  # PP: its shapes
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
    monitor = RunMonitor(accelerator, args, "train_hybrid", feed, layout.world_size, global_batch_size)
    window = {"grad_accum": grad_accum, "unsharded_accumulation": unsharded}
    costs = sharded_start_line(model, layout, n_params, args.optimizer, accelerator, **window)
    monitor.start(task, model_line, n_params, data, [order_line(layout, args), costs], resume_path, layout)
    pp_group = layout.group("pp")

    # ---------------------------------------- the training loop
    step, last_step = progress["step"], min(args.max_steps, args.stop_at_step or args.max_steps)
    model.train()
    while step < last_step and not feed.preempted:
        with monitor.timed_step():  # training time (not the records, evaluations, checkpoints)
            micro_batches, n_global_targets = feed.next_step()
            # PP: through the stages; TP: every layer's f/g; FSDP: per unit all-gather, reduce-scatter
            with monitor.collectives():  # counts the first step's collectives
                loss_sum = forward_backward(micro_batches, n_global_targets)  # a rank per replica
            grad_norm = clip_grad_norm_(model.parameters(), args.max_grad_norm, pp_group)  # sharded, over the stages
            lr = scheduler.get_last_lr()[0]
            optimizer.step()  # each rank updates what it holds
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

        if monitor.due(step, "train"):
            # Accelerate: the loss sums of all ranks (an all-reduce)
            loss = (accelerator.reduce(loss_sum, reduction="sum") / n_global_targets).item()
            monitor.train(step, loss, lr, grad_norm)
        if monitor.due(step, "eval"):  # each sample counted once
            result = evaluate(accelerator, model, task, data.validation, eval_batch_size, layout, predict)
            monitor.eval(step, result)
        if monitor.due(step, "checkpoint") or feed.preempted:  # every rank writes its part
            save_checkpoint(accelerator, args, step, feed, model, optimizer, scheduler, facts)
    feed.close()

    # ---------------------------------------- save
    if step == args.max_steps:  # every rank: gathers the shards; one rank per stage sends its units
        export_model(accelerator, model, task, data_source(args), Path(args.output_dir) / "model", layout)
    costs = sharded_summary(accelerator, layout, n_params, args.optimizer, model, optimizer, **window)
    monitor.summary(step, preempted=feed.preempted, **costs, **(pipeline.meter.summary(args) if pipeline else {}))
    accelerator.wait_for_everyone()
    accelerator.end_training()  # Accelerate: closes trackers, destroys the process group


if __name__ == "__main__":
    run_main(main)
