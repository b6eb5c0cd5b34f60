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
    stage 3: .  .  .  F0 F1 F2 F3 B3 B2 B1 B0 .  .  .      every stage holds 4 micro-batches' activations

    1F1B: same bubble, but each stage starts backward as soon as it can, so it holds at most
    (stages - its index) micro-batches' activations instead of all of them
    stage 0: F0 F1 F2 F3 .  .  .  B0 .  B1 .  B2 .  B3
    stage 3: .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .  .

    bubble (idle fraction) of both: (p - 1) / (m + p - 1) for p stages and m micro-batches.
    interleaved 1F1B (--stages_per_rank 2): each rank holds 2 smaller stages, bubble / 2.
    zero bubble: backward split into input-gradient and weight-gradient parts; the weight parts fill the bubble.

Run it:
    accelerate launch --config_file accelerate_configs/cpu_multi.yaml scripts/train_pp.py --schedule 1f1b
    accelerate launch ... --num_processes 4 scripts/train_pp.py \\
        --n_layer 8 --schedule interleaved_1f1b --n_microbatches 8
--batch_size is the batch the schedule splits into --n_microbatches (use it instead of gradient
accumulation); evaluation runs through the pipeline with the same batch shape. Pure pipeline
parallel: every process is one pipeline rank. Pipelines trained data parallel (dp x pp) are
train_hybrid.py's (--pp_size N --dp_shard M). Lines marked `# PP:` are the strategy; the stage
split and the arithmetic behind it (common/pipeline.py) know the model only through its Task.
"""

import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts run as files: copy common/ beside this file

import torch
import torch.nn as nn
from accelerate.utils import set_seed
from torch.distributed.pipelining import PipelineStage, schedules
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from common.checkpoint import check_resume_and_output, export_model, load_checkpoint, save_checkpoint
from common.cli import batch_of_step, build_parser, check_core_args, data_source
from common.costs import count_parameters
from common.cut_check import check_cut, uncut_copy
from common.errors import UsageError
from common.evaluation import evaluate
from common.launch import make_accelerator, run_main
from common.layout import Layout
from common.loader import make_train_loader
from common.metrics import RunMonitor
from common.pipeline import (
    MULTI_STAGE_SCHEDULES,
    add_pipeline_args,
    bubble_theory,
    check_pipeline_layout,
    parse_pipeline_flags,
    stage_layers,
    stages_of_rank,
)
from common.sharded import clip_grad_norm_, shard_loader
from common.sharded_costs import sharded_start_line, sharded_summary
from common.task import check_task_contract
from common.training import StepFeed, compile_units, make_optimizer, make_scheduler, unit_modules


# ======================================== MODEL: how one pipeline stage of the model runs (docs/your-model.md)
def stage_modules(model: nn.Module, stages: list[tuple[range, bool, bool]]) -> list[nn.Module]:
    """This rank's stages, one module per (units, is_first, is_last); the parts only the first stage
    uses (embeddings) go where this rank holds no first stage, those of the last (final norm, head)
    where it holds no last. A 🤗 model of any family: its parts in the order of its own pipeline plan
    (config.base_model_pp_plan), each stage running the family's own forward (HFPipelineStage)."""
    from common.model import GPT, GPTStage

    holds_first, holds_last = any(first for _, first, _ in stages), any(last for _, _, last in stages)
    if isinstance(model, GPT):
        if not holds_first:
            model.tok_emb = model.pos_emb = None
        if not holds_last:
            model.ln_f = model.lm_head = None
        return [GPTStage(model, units, first, last) for units, first, last in stages]
    parts = hf_pipeline_parts(model)
    if not (holds_first and holds_last):  # a tied head would be the embedding of another rank
        from common.hf import check_untied

        check_untied(model, "pipeline parallelism")
    base = model.base_model
    for name in () if holds_first else parts.before:
        setattr(base, name, None)  # the embedding (and its dropout): freed here, skipped by the TP plan
    if not holds_last:
        for name in parts.after:
            setattr(base, name, None)  # the final norm
        setattr(model, parts.head, None)  # the output layer
    return [HFPipelineStage(model, parts, units, first, last) for units, first, last in stages]


class HFPipelineParts(NamedTuple):
    """A 🤗 model's parts in pipeline order, named as its own forward reads them: the base model's
    children before its decoder layers (embedding, embedding dropout), the layers' path from the root,
    the children after them (final norm), and the output layer, a child of the root."""

    before: tuple[str, ...]
    layers: str
    after: tuple[str, ...]
    head: str


def hf_pipeline_parts(model: nn.Module) -> HFPipelineParts:
    """From the family's base_model_pp_plan: llama {embed_tokens, layers, norm}, gpt_neox {embed_in,
    emb_dropout, layers, final_layer_norm}; the output layer is get_output_embeddings() (lm_head).
    A family without a plan, or with weights outside it, is refused: no stage would know where they run."""
    c, family, base = model.config, model.config.model_type, model.base_model
    plan = list(getattr(c, "base_model_pp_plan", None) or {})
    lists = [name for name in plan if isinstance(getattr(base, name, None), nn.ModuleList)]
    if len(lists) != 1:
        raise UsageError(
            f"--pp_size: {family} has no pipeline plan with one list of decoder layers in transformers "
            f"(config.base_model_pp_plan: {plan or 'empty'}), so nothing says which parts come before and after "
            "its layers: train it with train_fsdp.py"
        )
    cut = plan.index(lists[0])
    head = model.get_output_embeddings()
    head_name = next((n for n, m in model.named_children() if m is head), None) if head is not None else None
    outside = [n for n, m in base.named_children() if n not in plan and any(True for _ in m.parameters())]
    outside += [
        f"{n} (beside the base model)"
        for n, m in model.named_children()
        if m is not base and n != head_name and any(True for _ in m.parameters())
    ]
    if head_name is None or outside:
        held = f"holds {', '.join(outside)} outside" if outside else "has no output layer among the children of"
        raise UsageError(
            f"--pp_size: {family} {held} its pipeline plan ({', '.join(plan)}, then the output layer), so no "
            "stage would run it: train it with train_fsdp.py"
        )
    prefix = f"{model.base_model_prefix}." if model.base_model_prefix else ""
    return HFPipelineParts(tuple(plan[:cut]), prefix + lists[0], tuple(plan[cut + 1 :]), head_name)


class PassThrough(nn.Module):
    """Stands in, during one stage's forward, for a part another stage runs (a decoder layer, the embedding's
    dropout, the final norm): returns the hidden states it is given, whatever else the family's forward
    passes it (masks, rotary cos/sin, the cache)."""

    def forward(self, hidden_states=None, *args, **kwargs):
        return hidden_states


class HFPipelineStage(nn.Module):
    """One pipeline stage of a 🤗 model: some of its decoder layers, run by the family's own forward, so
    each layer gets the mask of its own kind (full, sliding window: config.layer_types, by its index in the
    model), its rotary cos/sin, Gemma's scaled embedding, gpt-oss's sinks... For the call, every part this
    stage does not run is a PassThrough; then the model is put back as it was (this rank's other stages,
    and None for what was dropped: the TP plan and the checkpoints see the model's own names). Input: token
    ids on the first stage, else hidden states (batch, seq, hidden), given as inputs_embeds; output: the
    last decoder layer's hidden states, or the logits on the last stage (the family's whole head:
    final norm, output layer, soft-capping). It registers only what it runs (its FSDP root, the
    PipelineStage's parameters); the model is not a submodule, since it holds the other stages' parts."""

    def __init__(self, model: nn.Module, parts: HFPipelineParts, layers: range, is_first: bool, is_last: bool):
        super().__init__()
        self.__dict__["whole"] = model  # not registered: see above
        self.parts, self.layer_ids, self.is_first, self.is_last = parts, set(layers), is_first, is_last
        base, units = model.base_model, model.get_submodule(parts.layers)
        self.layers = nn.ModuleDict({str(i): units[i] for i in layers})
        ends = (parts.before if is_first else ()) + (parts.after if is_last else ())
        self.ends = nn.ModuleDict({name: getattr(base, name) for name in ends if getattr(base, name) is not None})
        self.head = getattr(model, parts.head) if is_last else None

    @contextmanager
    def running_alone(self):
        """The model with every part this stage does not run replaced by a PassThrough, for the call."""
        base, units = self.whole.base_model, self.whole.get_submodule(self.parts.layers)
        slots = [(units, str(i)) for i in range(len(units)) if i not in self.layer_ids]
        slots += [(base, name) for name in (() if self.is_first else self.parts.before)]
        slots += [(base, name) for name in (() if self.is_last else self.parts.after)]
        saved = [owner._modules[name] for owner, name in slots]
        for owner, name in slots:
            owner._modules[name] = PASS_THROUGH
        try:
            yield
        finally:
            for (owner, name), module in zip(slots, saved, strict=True):
                owner._modules[name] = module

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None):
        inputs = {"input_ids": x} if self.is_first else {"inputs_embeds": x}  # the embedding runs on stage 0 only
        with self.running_alone():  # --document_mask: position_ids travel on with the hidden states
            if self.is_last:
                return self.whole(**inputs, position_ids=position_ids).logits
            hidden = self.whole.base_model(**inputs, position_ids=position_ids).last_hidden_state
        return hidden if position_ids is None else (hidden, position_ids)


PASS_THROUGH = PassThrough()


def check_stages_compute(model: nn.Module, ranges: list[range], n_tokens: int = 64) -> None:
    """Before any part is dropped: the stages chained give the whole model's logits, on a few tokens (eval
    mode, no gradients, the global RNG untouched). Proof, for any family, that its forward does nothing to
    the hidden states between the parts of its pipeline plan that a stage would miss or repeat (a family
    that does is refused, one line). The built-in GPT's stages are its own embed/head code: not checked."""
    from common.model import GPT

    c = getattr(model, "config", None)
    if isinstance(model, GPT) or not hasattr(c, "vocab_size"):  # a model of one's own: the cut check proves it
        return
    stages = stage_modules(model, [(r, s == 0, s == len(ranges) - 1) for s, r in enumerate(ranges)])  # drops nothing
    device = next(model.parameters()).device
    n_tokens = min(n_tokens, getattr(c, "max_position_embeddings", None) or n_tokens)
    ids = torch.randint(c.vocab_size, (2, n_tokens), generator=torch.Generator().manual_seed(0)).to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            whole, x = model(input_ids=ids).logits, ids
            for stage in stages:
                x = stage(x)
    finally:
        model.train(was_training)
    diff = (whole - x).abs().max().item() if x.shape == whole.shape else float("inf")
    if not diff <= 1e-5:
        raise UsageError(
            f"--pp_size: {c.model_type}'s {len(ranges)} pipeline stages, chained, do not give the whole model's "
            f"logits (max |diff| {diff:.2g} on {n_tokens} tokens): its forward does more to the hidden states "
            "than the parts of its pipeline plan (config.base_model_pp_plan) hold; train it with train_fsdp.py"
        )


# ======================================== PP: the strategy
def split_pipeline(
    model: nn.Module, units, layout: Layout, stage_modules, stages_per_rank: int = 1, split_points=None
) -> list[nn.Module]:
    """Cut the model's repeated `units` (a ModuleDict or ModuleList) into pp x stages_per_rank stages.
    This rank keeps only its stages' units: the others are deleted from a ModuleDict, or replaced by
    nn.Identity() in a ModuleList so the remaining ones keep their indices; either way every parameter
    keeps its full-model name (checkpoints move between layouts) and the dropped ones' memory is freed.
    `stage_modules(model, [(units, is_first, is_last), ...])` (the MODEL section's) builds one module
    per stage and drops the first- and last-stage parts this rank does not hold."""
    n_stages = layout.pp * stages_per_rank
    ranges = stage_layers(len(units), n_stages, split_points)
    mine = stages_of_rank(layout.pp_rank, layout.pp, stages_per_rank)
    check_stages_compute(model, ranges)  # the MODEL section's stages, chained on the whole model, are the model
    keep = {i for s in mine for i in ranges[s]}
    names = list(units.keys()) if isinstance(units, nn.ModuleDict) else list(range(len(units)))
    for i, name in enumerate(names):
        if i in keep:
            continue
        if isinstance(units, nn.ModuleDict):
            del units[name]
        else:
            units[i] = nn.Identity()  # a placeholder without parameters: the others keep their indices
    return stage_modules(model, [(ranges[s], s == 0, s == n_stages - 1) for s in mine])


def check_pp_size(pp_size: int, world: int) -> None:
    """One strategy per file: every process is one pipeline rank; dp x pp is train_hybrid.py's."""
    if pp_size not in (-1, world):
        raise UsageError(
            f"--pp_size {pp_size} on {world} processes: train_pp.py is pure pipeline parallel, every process "
            "one pipeline rank (drop --pp_size); pipelines trained data parallel (dp x pp) are train_hybrid.py's: "
            f"--pp_size N --dp_shard M, N x M = {world}"
        )


def pipeline_start_lines(layout: Layout, n_units: int, args) -> list[str]:
    """The stages and the units each holds, the schedule and its micro-batches, the bubble in theory."""
    n_stages = layout.pp * args.stages_per_rank
    ranges = stage_layers(n_units, n_stages, args.split_points)
    stage_list = ", ".join(f"{s}: units {r.start}-{r.stop - 1}" for s, r in enumerate(ranges))
    bubble = bubble_theory(layout.pp, args.n_microbatches, args.stages_per_rank)
    pipeline_line = (
        f"pipeline: {n_stages} stages ({stage_list}), schedule {args.schedule}, "
        f"{args.n_microbatches} micro-batches of {args.batch_size // args.n_microbatches}"
    )
    bubble_line = f"bubble in theory: (p-1)/(v*m+p-1) = {bubble:.3f}; measured in the summary"
    return [pipeline_line, bubble_line]


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


def build_schedule(chunks: list[nn.Module], layout: Layout, schedule: str, n_microbatches: int, loss_fn, device):
    """One PipelineStage per stage module and the schedule that runs them. `scale_grads=False`: the
    loss function already divides by the global batch's target count (docs/troubleshooting.md,
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


class PipelineStep:
    """The step under pipeline parallelism: the schedule runs forward and backward of all
    micro-batches through the stages. The first stage gets the inputs (Task.inputs), the last the
    targets (Task.targets) and computes each micro-batch's loss (Task.loss), already divided by the
    global target count; the loss sum is reported by the rank that holds it (Layout.holds_loss: the
    last stage, TP rank 0), zero elsewhere."""

    def __init__(
        self,
        accelerator,
        layout: Layout,
        task,
        chunks,
        schedule: str,
        n_microbatches: int,
        use_loss_parallel: bool = False,
    ):
        self.accelerator, self.layout, self.task, self.use_loss_parallel = accelerator, layout, task, use_loss_parallel
        self.schedule, self.stages = build_schedule(
            chunks, layout, schedule, n_microbatches, self.loss_fn, accelerator.device
        )
        self.has_first = any(stage.is_first for stage in self.stages)
        self.has_last = any(stage.is_last for stage in self.stages)
        self.scale, self.scoring = 1.0, True
        self.busy_s = self.step_s = 0.0
        self.max_in_flight, self.steps = 0, 0

    def loss_fn(self, outputs, targets):
        if not self.scoring:  # predict(): forward only, the outputs are what is wanted
            return torch.zeros((), device=self.accelerator.device)
        loss_sum, _ = self.task.loss(outputs, targets)
        return loss_sum * self.scale

    def _context(self):
        return loss_parallel() if self.use_loss_parallel else nullcontext()

    def __call__(self, micro_batches: list, n_global_targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of the whole batch; returns this replica's loss sum where it is reported."""
        (mb,) = micro_batches  # the schedule splits the batch into micro-batches itself
        self.scale = self.layout.dp / n_global_targets  # times dp: FSDP averages gradients over the dp ranks
        for stage in self.stages:
            stage.reset_counters()
        inputs = self.task.inputs(mb) if self.has_first else ()
        inputs = tuple(x for x in inputs if x is not None)  # a 🤗 model's (input_ids, None, position_ids): no mask
        target = self.task.targets(mb) if self.has_last else None
        losses = []  # the last stage's loss per micro-batch, as loss_fn returned it
        start = time.perf_counter()
        with self.accelerator.autocast(), self._context():  # Accelerate: autocast
            self.schedule.step(*inputs, target=target, losses=losses)  # PP: the whole schedule, forward and backward
        if self.steps > 0:  # the first step also sets up the stages: leave it out of the bubble figure
            self.step_s += time.perf_counter() - start
            self.busy_s += sum(stage.busy_s for stage in self.stages)
        self.max_in_flight = max([self.max_in_flight, *(stage.max_in_flight for stage in self.stages)])
        self.steps += 1
        if not losses or not self.layout.holds_loss:
            return torch.zeros((), device=self.accelerator.device)
        losses = [loss.full_tensor() if isinstance(loss, DTensor) else loss for loss in losses]
        return torch.stack(losses).sum().detach() / self.scale  # back to this replica's loss sum

    def predict(self, *inputs):
        """Forward only, through the pipeline (evaluate's `predict`): the last stage gets the outputs
        of the whole batch, the others None. (The schedule also calls its loss function there; the
        first input stands in for the targets, and loss_fn scores nothing.)"""
        self.scoring = False
        try:
            with self._context():
                outputs = self.schedule.eval(
                    *(tuple(x for x in inputs if x is not None) if self.has_first else ()),
                    target=inputs[0] if self.has_last else None,
                )
        finally:
            self.scoring = True
        return outputs if self.has_last else None

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


def main():
    # ---------------------------------------- flags
    parser = build_parser(__doc__)
    from common.builtin_flags import add_builtin_flags  # the built-in data sets' and models' flags

    add_builtin_flags(parser)  # data and a model of your own: drop these two lines
    g = add_pipeline_args(parser)  # PP: the "pipeline parallel" flag group (common/pipeline.py), and one more
    pp_help = "pipeline ranks: every process (-1, or the number of processes); pipelines trained data parallel "
    g.add_argument("--pp_size", type=int, default=-1, help=pp_help + "are train_hybrid.py's (--pp_size N --dp_shard M)")
    args = parser.parse_args()
    args.output_dir = args.output_dir or "runs/pp"
    check_core_args(args)
    parse_pipeline_flags(args)  # PP: the schedule, --stages_per_rank, --n_microbatches, --split_points

    # ---------------------------------------- Accelerator and layout
    # Accelerate: process group (gloo on CPU, NCCL on GPU), device, mixed precision from the launcher.
    # cpu=True where CUDA is missing: the N processes then join one gloo group (without it, each trains alone).
    # The scheduler counts optimizer steps (step_scheduler_with_optimizer=False), whatever the layout.
    accelerator = make_accelerator(
        args,
        cpu=args.cpu or not torch.cuda.is_available(),
        sharded=True,  # refuses a launch that also asks Accelerate to shard
        step_scheduler_with_optimizer=False,
    )
    check_pp_size(args.pp_size, accelerator.num_processes)  # PP: pure pipeline parallel (dp x pp: train_hybrid.py)
    layout = Layout.from_degrees(accelerator.num_processes, pp=-1, dp_shard=1)  # PP: every process is a stage
    dp_size = layout.dp  # PP: 1, one pipeline: every stage reads the same batch
    grad_accum, global_batch_size = batch_of_step(args, dp_size)  # batch_size x dp_size x accumulation

    # ---------------------------------------- data (checked before anything is written)
    # the built-in data sets (addition, pystdlib, hub, your files), cut to the model's context, in its tokens
    from common.data import load_data
    from common.model import context_length, tokenizer_for

    data = load_data(args, accelerator, context_length(args), tokenizer_for(args))
    train_loader = make_train_loader(data.train, args.batch_size, global_batch_size, args.seed)

    # ---------------------------------------- MODEL: the only lines that name the model (docs/your-model.md)
    set_seed(args.seed)  # Accelerate: the same full model on every rank: init independent of the layout
    # the built-in GPT, or a 🤗 transformers causal LM (--model_name_or_path, --model_config), and its Task:
    # the loss of a micro-batch as (loss_sum, n_targets), the targets it counts, its evaluation and export
    from common.model import language_model

    model, task = language_model(args, data)
    model = model.to(accelerator.device)
    units = task.units(model)  # the repeated units: the pipeline cuts between them (stage_modules, above), --compile
    n_params, model_line = count_parameters(model), task.describe(model)
    n_units = len(units)  # PP: counted before the split, which drops the other stages' units
    check_pipeline_layout(layout, n_units, args, type(unit_modules(units)[0]).__name__)  # PP: a unit per stage
    resume_path, facts = check_resume_and_output(accelerator, args, model, task, global_batch_size, layout)
    reference = uncut_copy(model, task, args.skip_cut_check)  # the model as built: what the cut must compute
    layout.build_mesh(accelerator.device.type)

    # ---------------------------------------- PP: the strategy
    # keep this rank's units and one module per stage it holds (its embeddings, its norm and head)
    stages = split_pipeline(model, units, layout, stage_modules, args.stages_per_rank, args.split_points)
    if args.compile:
        compile_units(units, accelerator)  # this rank's units
    pipeline = PipelineStep(accelerator, layout, task, stages, args.schedule, args.n_microbatches)  # PP: the schedule

    # ---------------------------------------- optimizer (after the split: this rank's units)
    optimizer = make_optimizer(model, args)
    scheduler = make_scheduler(optimizer, args)
    # Accelerate: optimizer/scheduler wrappers (not the model: PP owns it); the loader sharded over the dp ranks
    optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
    train_sampler = train_loader.sampler
    train_loader = shard_loader(train_loader, accelerator, layout)
    check_task_contract(task, reference, data.validation, "cpu")  # PP: on the uncut copy (no rank holds the model)
    probe_step = pipeline  # PP: the schedule, on a probe
    probe_step.micro_batch_size = args.batch_size  # PP: the shapes its stages send each other
    cut_line = check_cut(accelerator, model, probe_step, reference, task, data.validation, grad_accum, layout)
    progress = load_checkpoint(accelerator, resume_path, model, optimizer, scheduler)  # step 0 without a checkpoint
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
    feed.seed_dropout(args.seed, layout)  # dropout: each data-parallel rank its own masks, a resume the same ones
    monitor = RunMonitor(accelerator, args, "train_pp", feed, layout.world_size, global_batch_size)
    pp_lines = pipeline_start_lines(layout, n_units, args)  # PP: the stages, the schedule, the bubble in theory
    costs = sharded_start_line(model, layout, n_params, args.optimizer, accelerator)
    monitor.start(task, model_line, n_params, data, [*pp_lines, costs, cut_line], resume_path, layout)
    pp_group = layout.group("pp")  # PP: the gradient norm sums over the stages

    # ---------------------------------------- the training loop
    step, last_step = progress["step"], min(args.max_steps, args.stop_at_step or args.max_steps)
    model.train()
    while step < last_step and not feed.preempted:
        with monitor.timed_step():  # training time: the records, evaluations and checkpoints below are not
            micro_batches, n_global_targets = feed.next_step()
            with monitor.collectives():  # PP: each micro-batch through every stage, forward and backward (counted once)
                loss_sum = pipeline(micro_batches, n_global_targets)  # PP: the loss sum on the last stage only
            grad_norm = clip_grad_norm_(model.parameters(), args.max_grad_norm, pp_group)  # PP: over the stages
            lr = scheduler.get_last_lr()[0]
            optimizer.step()  # PP: each rank updates its own units
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

        if monitor.due(step, "train"):
            loss = (accelerator.reduce(loss_sum, reduction="sum") / n_global_targets).item()  # Accelerate: all-reduce
            monitor.train(step, loss, lr, grad_norm)
        if monitor.due(step, "eval"):
            result = evaluate(  # PP: forward only, through the pipeline, with the training batch's shape
                accelerator, model, task, data.validation, args.batch_size, layout, predict=pipeline.predict
            )
            monitor.eval(step, result)
        if monitor.due(step, "checkpoint") or feed.preempted:  # every rank writes its part (a collective)
            save_checkpoint(accelerator, args, step, feed, model, optimizer, scheduler, facts)
    feed.close()

    # ---------------------------------------- save
    if step == args.max_steps:  # every rank (it gathers what the model holds); the main process writes
        export_model(accelerator, model, task, data_source(args), Path(args.output_dir) / "model", layout)
    costs = sharded_summary(accelerator, layout, n_params, args.optimizer, model, optimizer)
    monitor.summary(step, preempted=feed.preempted, **costs, **pipeline.summary(args))  # PP: the measured bubble
    accelerator.wait_for_everyone()
    accelerator.end_training()  # Accelerate: closes trackers and destroys the process group


if __name__ == "__main__":
    run_main(main)
