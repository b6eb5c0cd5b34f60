#!/usr/bin/env python
"""Tensor parallelism (Megatron-style) with PyTorch DTensor, under 🤗 Accelerate.

Every weight matrix of a block is cut across the ranks of a TP group; all of them see the same
batch and together compute one layer. Column-parallel layers split their outputs (attention
heads, MLP columns), row-parallel ones their inputs, so each pair needs one all-reduce:

    one block, tp = 2 (x: activations, replicated on both ranks)
                   rank 0                            rank 1
    f ->  q,k,v[:, heads 0..h/2)   attention    q,k,v[:, heads h/2..h)   attention     column-wise
          o_proj[heads 0..h/2 , :]  -> partial  o_proj[heads h/2..h, :]  -> partial    row-wise
    g ->                 all-reduce(partial + partial) = attention output
    f ->  up_proj[:, cols 0..2d)       GELU     up_proj[:, cols 2d..4d)      GELU      column-wise
          down_proj[cols 0..2d, :] -> partial   down_proj[cols 2d..4d, :] -> partial   row-wise
    g ->                 all-reduce = MLP output

    f: identity forward, all-reduce of the input gradient backward;  g: all-reduce forward, identity backward.
    Embedding: vocab rows split (each rank looks up the tokens it holds, partial sums all-reduced).
    LM head: vocab columns split; --loss_parallel computes the cross-entropy on the shards.
    --sequence_parallel: LayerNorms and dropout work on a slice of the sequence; each all-reduce
    becomes an all-gather (before attention/MLP) plus a reduce-scatter (after them).

Run it:
    accelerate launch --config_file accelerate_configs/cpu_multi.yaml scripts/train_tp.py
    accelerate launch --config_file accelerate_configs/gpu_multi.yaml scripts/train_tp.py \\
        --sequence_parallel --loss_parallel
    python scripts/train_tp.py                     # one process: nothing to split, the plan is not applied
TP only: the TP group is every process. Data parallel beside TP (dp x tp) is train_hybrid.py's.
The MODEL section holds the plan, {module name: how to split it}: the built-in GPT's, or a 🤗
Llama-family model's (common/hf.py). Lines marked `# TP:` are the strategy; `# Accelerate:` the
library's part.
"""

import sys
from contextlib import nullcontext
from fnmatch import fnmatch
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts run as files: copy common/ beside this file

import torch
import torch.nn as nn
from accelerate.utils import set_seed
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from common.checkpoint import check_resume_and_output, export_model, load_checkpoint, save_checkpoint
from common.cli import build_parser, check_core_args, data_source
from common.costs import count_parameters
from common.errors import UsageError
from common.evaluation import evaluate
from common.launch import make_accelerator, run_main
from common.layout import Layout
from common.loader import make_train_loader
from common.metrics import RunMonitor
from common.sharded_costs import sharded_start_line, sharded_summary
from common.task import check_task_contract
from common.training import StepFeed, clip_grad_norm_, compile_units, make_optimizer, make_scheduler, shard_loader


# ======================================== MODEL: the TP plan, {module name: style} (docs/your-model.md)
def tensor_parallel_plan(model: nn.Module, sequence_parallel: bool, loss_parallel: bool) -> dict:
    """Megatron's split of the built-in GPT, as a parallelize_module plan (only for the parts this rank holds).

    Per block: q/k/v column-wise (each rank computes n_head/tp heads), o_proj row-wise;
    up_proj column-wise, down_proj row-wise. One all-reduce after o_proj and one after
    down_proj in forward (Megatron's g), one each at the block's inputs in backward (f).
    With sequence parallel the norms work on a slice of the sequence, and each all-reduce
    becomes an all-gather before attention/MLP plus a reduce-scatter after them."""
    seq = Shard(1)  # the sequence dimension of (batch, seq, hidden)
    between_blocks = seq if sequence_parallel else Replicate()
    plan = {}
    if model.tok_emb is not None:  # vocab-parallel: each rank holds vocab/tp rows; partial sums are reduced
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between_blocks)
        if sequence_parallel:  # positions of this rank's sequence slice, to add to its token slice
            plan["pos_emb"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
    for name in model.blocks:
        b = f"blocks.{name}"
        plan.update(
            {
                f"{b}.attn.q_proj": ColwiseParallel(),
                f"{b}.attn.k_proj": ColwiseParallel(),
                f"{b}.attn.v_proj": ColwiseParallel(),
                f"{b}.attn.o_proj": RowwiseParallel(output_layouts=between_blocks),
                f"{b}.mlp.up_proj": ColwiseParallel(),
                f"{b}.mlp.down_proj": RowwiseParallel(output_layouts=between_blocks),
                # attention and MLP take their input as one replicated DTensor (all-gathered from the sequence
                # slices under SP): q, k and v share it, so backward reduces its gradient once, not 3 times
                f"{b}.attn": PrepareModuleInput(input_layouts=(between_blocks,), desired_input_layouts=(Replicate(),)),
                f"{b}.mlp": PrepareModuleInput(input_layouts=(between_blocks,), desired_input_layouts=(Replicate(),)),
            }
        )
        if sequence_parallel:
            plan.update({f"{b}.ln_1": SequenceParallel(), f"{b}.ln_2": SequenceParallel()})
    if model.lm_head is not None:
        if sequence_parallel:
            plan["ln_f"] = SequenceParallel()
        # loss parallel: keep the logits sharded over the vocabulary; the loss is computed on the shards
        plan["lm_head"] = ColwiseParallel(
            input_layouts=between_blocks,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    return plan


def model_tp_plan(model: nn.Module, task, layout: Layout, sequence_parallel: bool, loss_parallel: bool) -> dict:
    """This model's plan, after checking that the TP degree divides what the plan splits (heads, MLP
    width, vocabulary): a 🤗 Llama-family model's (its units at model.layers; common/hf.py), else the
    built-in GPT's (above). A model of your own: return its plan here (docs/your-model.md)."""
    if getattr(task, "hf_config", None) is not None:  # a 🤗 transformers model (HFCausalLMTask)
        from common.hf import check_tp_divides, llama_tp_plan

        check_tp_divides(model, layout.tp)
        return llama_tp_plan(model, sequence_parallel, loss_parallel)
    from common.model import check_gpt_split

    check_gpt_split(task.cfg, layout.tp)  # the GPTConfig: TP divides heads, MLP width (4 x n_embd), vocabulary
    return tensor_parallel_plan(model, sequence_parallel, loss_parallel)


# ======================================== TP: the strategy
WHERE = "in the MODEL section of train_tp.py (docs/your-model.md)"


def check_tp_plan(model: nn.Module, plan: dict, sequence_parallel: bool, loss_parallel: bool) -> None:
    """Before parallelize_module, which only warns about a key that matches no module (and leaves that
    part whole), and would apply a plan that has no place for a flag (the flag then changes nothing):
    every key names a module of the model; --sequence_parallel has a SequenceParallel style to act on;
    --loss_parallel has an output layer that keeps its logits sharded over the vocabulary. One line each."""
    names = [name for name, _ in model.named_modules() if name]
    unmatched = [key for key in plan if key and not any(_key_matches(key, name) for name in names)]
    if unmatched:
        more = f" (and {len(unmatched) - 1} more key{'s' if len(unmatched) > 2 else ''})" if len(unmatched) > 1 else ""
        raise UsageError(
            f"the TP plan names '{unmatched[0]}'{more}, but the model ({type(model).__name__}) has no module by "
            f"that name; {_what_the_model_has(model, unmatched[0])}: name the model's modules in its TP plan, {WHERE}"
        )
    kinds = sorted({type(style).__name__ for style in plan.values()})
    if sequence_parallel and not any(isinstance(style, SequenceParallel) for style in plan.values()):
        raise UsageError(
            "--sequence_parallel: the TP plan has no SequenceParallel style (for the norms, which then work on a "
            f"slice of the sequence), only {', '.join(kinds)}: the plan ignores the flag; place SequenceParallel() "
            f"on the norms when sequence_parallel is set, {WHERE}, or drop --sequence_parallel"
        )
    if loss_parallel and not any(_shards_vocabulary(style) for style in plan.values()):
        columns = [(key, style) for key, style in plan.items() if isinstance(style, ColwiseParallel)]
        last = f"its last column-wise layer, {_output_of(*columns[-1])}" if columns else "it has no column-wise layer"
        raise UsageError(
            "--loss_parallel: the TP plan has no output layer that keeps its logits sharded over the vocabulary "
            f"(ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)); {last}: the plan ignores the "
            f"flag; shard the output layer that way when loss_parallel is set, {WHERE}, or drop --loss_parallel"
        )


def _key_matches(key: str, name: str) -> bool:
    """parallelize_module's matching: one fnmatch pattern per dotted part."""
    parts, pattern = name.split("."), key.split(".")
    return len(parts) == len(pattern) and all(fnmatch(p, q) for p, q in zip(parts, pattern, strict=True))


def _what_the_model_has(model: nn.Module, key: str) -> str:
    """The model's top-level modules, and those under the deepest part of `key` it has (else its first unit)."""

    def children(module: nn.Module) -> str:
        names = [name for name, _ in module.named_children()]
        return ", ".join(names[:8]) + (", ..." if len(names) > 8 else "") or "none"

    parts = key.split(".")
    found = ""
    for i in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:i])
        try:
            found = f"{prefix} holds {children(model.get_submodule(prefix))}"
            break
        except AttributeError:
            continue
    if not found:
        units = next(
            ((n, m) for n, m in model.named_modules() if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and len(m)), None
        )
        if units:
            first = next(iter(units[1].named_children()))
            found = f"its first unit, {units[0]}.{first[0]}, holds {children(first[1])}"
    return f"its top-level modules are {children(model)}" + (f"; {found}" if found else "")


def _shards_vocabulary(style) -> bool:
    return isinstance(style, ColwiseParallel) and not style.use_local_output and Shard(-1) in style.output_layouts


def _output_of(key: str, style) -> str:
    layouts = ", ".join(repr(layout) for layout in style.output_layouts)
    return f"'{key}', outputs {layouts} as a {'local tensor' if style.use_local_output else 'DTensor'}"


def apply_tensor_parallel(model: nn.Module, tp_mesh, plan: dict) -> None:
    """parallelize_module swaps each weight the plan names for a DTensor shard over `tp_mesh` (a 1-D mesh)
    and adds the f/g collectives as hooks. `plan`: {module name: style}, the MODEL section's (model_tp_plan),
    checked with check_tp_plan first."""
    parallelize_module(model, tp_mesh, plan)


def tp_forward_backward(
    accelerator,
    model,
    task,
    micro_batches: list,
    n_global_targets: torch.Tensor,
    use_loss_parallel: bool,
    dp_size: int = 1,
    counts_loss: bool = True,
) -> torch.Tensor:
    """Forward and backward of this rank's micro-batches (the whole TP group runs the same ones);
    returns their loss sum where `counts_loss` (the ranks of a TP group hold the same sum: one per group
    counts it, layout.holds_loss), else zero. Normalised by the global batch's target count, times
    `dp_size` where a data-parallel part (FSDP, train_hybrid.py) averages gradients over dp ranks."""
    step_loss_sum = torch.zeros((), device=accelerator.device)
    for i, mb in enumerate(micro_batches):
        if isinstance(model, FSDPModule):  # data parallel beside TP (hybrid): one reduce-scatter, at the last
            model.set_requires_gradient_sync(i == len(micro_batches) - 1)
        with (
            accelerator.autocast(),
            loss_parallel() if use_loss_parallel else nullcontext(),
        ):  # TP: loss on vocab shards
            loss_sum, _ = task.loss_of(model, mb)
            accelerator.backward(loss_sum * dp_size / n_global_targets)  # Accelerate: backward
        step_loss_sum += loss_sum.detach().full_tensor() if isinstance(loss_sum, DTensor) else loss_sum.detach()
    return step_loss_sum if counts_loss else torch.zeros_like(step_loss_sum)


def check_tp_layout(layout: Layout) -> None:
    """train_tp.py is TP only: a --tp_size that leaves data-parallel groups beside TP is train_hybrid.py's."""
    if layout.dp > 1:
        n = layout.world_size
        raise UsageError(
            f"--tp_size {layout.tp} on {n} processes leaves {layout.dp} data-parallel groups, but train_tp.py is "
            f"tensor parallel only: drop --tp_size (TP over all {n} processes), or train data parallel beside TP "
            f"with train_hybrid.py --dp_shard {layout.dp} --tp_size {layout.tp}"
            + (" (no TP split at all: train_fsdp.py)" if layout.tp == 1 else "")
        )


def check_tp_flags(layout: Layout, task, sequence_parallel: bool, loss_parallel: bool) -> None:
    """--sequence_parallel / --loss_parallel need a TP group; sequence parallel also needs samples that
    are sequences (Task.tokens_per_sample), and every rank an equal slice of them (docs/troubleshooting.md,
    "Sequence parallel needs a divisible sequence length")."""
    if layout.tp == 1 and (sequence_parallel or loss_parallel):
        flag = "sequence_parallel" if sequence_parallel else "loss_parallel"
        raise UsageError(
            f"--{flag} shards over the TP group, but --tp_size is 1: use --tp_size 2 or more, or drop --{flag}"
        )
    seq_len = task.tokens_per_sample
    if sequence_parallel and not seq_len:
        raise UsageError(
            "--sequence_parallel splits each sample's sequence over the TP ranks, but this task's samples are not "
            "sequences (Task.tokens_per_sample is None): drop --sequence_parallel"
        )
    if sequence_parallel and seq_len % layout.tp:
        hint = {
            "addition": "choose --addition_digits d with 3d+4 divisible by it (d = 4 gives 16 tokens)",
            "text": "use a --block_size divisible by it",
        }.get(getattr(task, "data_task", None), "use samples whose length it divides")
        raise UsageError(
            f"--sequence_parallel splits the {seq_len}-token sequence over --tp_size {layout.tp} ranks, "
            f"which does not divide it: {hint}"
        )


def tp_start_lines(model: nn.Module, plan: dict, layout: Layout, args, seq_len: int) -> tuple[list[str], dict]:
    """What the plan splits, and Megatron's count of the step's all-reduces (2 per row-wise Linear: g in
    forward, f in backward, each of b*s*d activations in fp32), for the start lines and the summary."""
    if layout.tp == 1:
        return ["tensor parallel: 1 rank per group: nothing to split, so the TP plan is not applied"], {}
    rowwise = [key for key, style in plan.items() if isinstance(style, RowwiseParallel)]
    row = [
        m
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and any(_key_matches(k, name) for k in rowwise)
    ]
    n_col = sum(isinstance(s, ColwiseParallel) for s in plan.values())
    n_row = sum(isinstance(s, RowwiseParallel) for s in plan.values())
    width = max((m.out_features for m in row), default=0)
    mib = 4 * args.batch_size * seq_len * width / 2**20  # one all-reduce of b*s*d, fp32
    on_off = {True: "on", False: "off"}
    lines = [
        f"tensor parallel: {layout.tp} ranks per group; the plan splits {n_col} layers column-wise (outputs: heads, "
        f"MLP columns, vocabulary) and {n_row} row-wise (inputs), 1/{layout.tp} of each per rank; sequence parallel "
        f"{on_off[args.sequence_parallel]}, loss parallel {on_off[args.loss_parallel]}",
        f"Megatron's count per step: 2 all-reduces per row-wise layer of b*s*d = {mib:.3f} MiB "
        f"({2 * len(row)} for {len(row)} row-wise Linear layers); measured below",
    ]
    figures = {
        "megatron_allreduce_mib_each": round(mib, 4),
        "megatron_allreduces_per_step": 2 * len(row) * args.gradient_accumulation_steps,
    }
    return lines, figures


def main():
    # ---------------------------------------- flags
    parser = build_parser(__doc__)
    g = parser.add_argument_group("tensor parallel")
    g.add_argument(
        "--tp_size",
        type=int,
        default=-1,
        help="ranks per TP group: all processes (-1, or their number); data parallel beside TP is train_hybrid.py's",
    )
    g.add_argument(
        "--sequence_parallel",
        action="store_true",
        help="shard LayerNorm/dropout activations along the sequence "
        "(all-gather + reduce-scatter instead of all-reduce)",
    )
    g.add_argument(
        "--loss_parallel",
        action="store_true",
        help="compute the cross-entropy on vocabulary-sharded logits, never gathering them",
    )
    args = parser.parse_args()
    args.output_dir = args.output_dir or "runs/tp"
    check_core_args(args)
    grad_accum = args.gradient_accumulation_steps

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
    dp_shard = 1 if args.tp_size == -1 else -1  # TP: a smaller --tp_size leaves dp groups (refused below)
    layout = Layout.from_degrees(accelerator.num_processes, tp=args.tp_size, dp_shard=dp_shard)  # TP: every rank
    check_tp_layout(layout)  # TP: TP only; data parallel beside TP is train_hybrid.py's
    dp_size = layout.dp  # TP: 1, every rank of the TP group reads the same batch
    global_batch_size = args.batch_size * dp_size * grad_accum

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
    units = task.units(model)  # the repeated units: --compile
    n_params, model_line = count_parameters(model), task.describe(model)
    # TP: the plan, {module name: style} (above); one rank has nothing to split
    plan = model_tp_plan(model, task, layout, args.sequence_parallel, args.loss_parallel) if layout.tp > 1 else {}
    if plan:  # TP: every key names a module of the model, every flag has a style to act on
        check_tp_plan(model, plan, args.sequence_parallel, args.loss_parallel)  # TP: the plan fits the model, flags
    check_tp_flags(layout, task, args.sequence_parallel, args.loss_parallel)  # TP: the flags fit the layout, data
    resume_path, facts = check_resume_and_output(accelerator, args, model, task, global_batch_size, layout)
    layout.build_mesh(accelerator.device.type)

    # ---------------------------------------- TP: the strategy
    # A TP group of one rank has nothing to split: the plan would only route every op through
    # DTensor, about 4x DDP's host time per step (docs/benchmarks.md). Like torchtitan, skip it.
    if layout.tp > 1:
        apply_tensor_parallel(model, layout.sub("tp"), plan)  # TP: every weight the plan names becomes a shard
    if args.compile:
        compile_units(units, accelerator)  # after the TP split

    # ---------------------------------------- optimizer (after sharding: it sees the shards)
    optimizer = make_optimizer(model, args)
    scheduler = make_scheduler(optimizer, args)
    # Accelerate: optimizer/scheduler wrappers (not the model: TP owns it); the loader sharded over the dp ranks
    optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
    train_sampler = train_loader.sampler
    train_loader = shard_loader(train_loader, accelerator, layout)
    lp = loss_parallel() if args.loss_parallel else None  # TP: the loss on vocabulary shards
    check_task_contract(task, model, data.validation, accelerator.device, lp)  # TP: with the loss on vocab shards
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
    monitor = RunMonitor(accelerator, args, "train_tp", feed, layout.world_size, global_batch_size)
    tp_lines, megatron = tp_start_lines(model, plan, layout, args, task.tokens_per_sample or 1)  # TP: what it splits
    costs = sharded_start_line(model, layout, n_params, args.optimizer, accelerator)
    monitor.start(task, model_line, n_params, data, [*tp_lines, costs], resume_path, layout)

    # ---------------------------------------- the training loop
    step, last_step = progress["step"], min(args.max_steps, args.stop_at_step or args.max_steps)
    holds_loss = layout.holds_loss  # TP: the ranks of a TP group hold the same loss sum: TP rank 0 counts it
    model.train()
    while step < last_step and not feed.preempted:
        with monitor.timed_step():  # training time: the records, evaluations and checkpoints below are not
            micro_batches, n_global_targets = feed.next_step()
            with monitor.collectives():  # TP: every layer's f/g collectives, inside forward and backward (counted once)
                loss_sum = tp_forward_backward(  # TP: the whole TP group runs the same micro-batches
                    accelerator, model, task, micro_batches, n_global_targets, args.loss_parallel, dp_size, holds_loss
                )
            grad_norm = clip_grad_norm_(model.parameters(), args.max_grad_norm)  # the whole model's norm, every rank
            lr = scheduler.get_last_lr()[0]
            optimizer.step()  # TP: each rank updates its slice of every matrix
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

        if monitor.due(step, "train"):
            loss = (accelerator.reduce(loss_sum, reduction="sum") / n_global_targets).item()  # Accelerate: all-reduce
            monitor.train(step, loss, lr, grad_norm)
        if monitor.due(step, "eval"):  # TP: each sample counted once, by TP rank 0 (layout.holds_loss)
            monitor.eval(step, evaluate(accelerator, model, task, data.validation, args.eval_batch_size, layout))
        if monitor.due(step, "checkpoint") or feed.preempted:  # every rank writes its part (a collective)
            save_checkpoint(accelerator, args, step, feed, model, optimizer, scheduler, facts)
    feed.close()

    # ---------------------------------------- save
    if step == args.max_steps:  # every rank (it gathers what the model holds); the main process writes
        export_model(accelerator, model, task, data_source(args), Path(args.output_dir) / "model", layout)
    costs = sharded_summary(accelerator, layout, n_params, args.optimizer, model, optimizer)
    monitor.summary(step, preempted=feed.preempted, **costs, **megatron)  # TP: with Megatron's count
    accelerator.wait_for_everyone()
    accelerator.end_training()  # Accelerate: closes trackers and destroys the process group


if __name__ == "__main__":
    run_main(main)
