#!/usr/bin/env python
"""Context parallelism (CP) with 🤗 Accelerate: ring attention, or Ulysses' all-to-alls.

Long sequences run out of activation memory before they run out of weights. CP cuts every
sequence over `cp` ranks; each rank runs the whole model on its own tokens. Only attention needs
the others: their keys and values travel around a ring of the CP ranks, one block per step, while a
rank computes on the one it has (the transfers: common/cp_comms.py).

    ring of cp = 4 (forward, one layer): step s, rank r holds the K/V of rank r - s
        rank 0 --K/V--> rank 1 --K/V--> rank 2 --K/V--> rank 3 --K/V--> (rank 0)
        each step: start sending the block on, attend to it (causal, blockwise), merge (log-sum-exp)
    backward: the K/V go round again; each block's dK/dV accumulate on the way home to their owner

    head-tail balancing, 8 chunks of a sequence (2 x cp), causal mask: late tokens see more
        chunk:   0  1  2  3  4  5  6  7
        rank:    0  1  2  3  3  2  1  0     rank r holds chunks r and 2cp-1-r: the same work each

--cp_impl ulysses (DeepSpeed-Ulysses): an all-to-all turns q, k, v (batch, heads, tokens/cp, d) into
(batch, heads/cp, tokens, d), attention on whole sequences, an all-to-all back: fewer bytes than the
ring, none hidden behind compute; the heads must divide by cp. FSDP shards over dp x cp.

Run it on 2 CPU processes (one ring), on 4 (dp 2 x cp 2), or as one process (nothing to cut):
    accelerate launch --config_file accelerate_configs/cpu_multi.yaml scripts/train_cp.py
    accelerate launch ... --num_processes 4 scripts/train_cp.py --cp_size 2 --cp_impl ulysses
    python scripts/train_cp.py
Lines marked `# Accelerate:` are the library's part; the rest is plain PyTorch.
`# CP:` marks the strategy: the ring's loop and merge below call common/context_parallel.py (the
chunk rule, the blocks, the kernels, a rank's loss); refusals and bytes: cp_checks.py, cp_costs.py.
"""

import sys
from functools import partial
from pathlib import Path

# scripts run as files: copy common/ beside this file
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from accelerate.utils import set_seed
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from common.checkpoint import export_model, load_checkpoint, save_checkpoint, start_point
from common.cli import batch_of_step, build_parser, check_core_args, data_source
from common.context_parallel import (
    add_sinks,
    block_attention,
    block_attention_backward,
    blocks_per_rank,
    cp_chunks,
    cp_loss,
    plain_attention,
    ring_steps,
    sinks_grad,
    step_blocks,
    whole_sequence_attention,
    whole_sequence_predict,
)
from common.contract_check import check_task_contract
from common.costs import count_parameters
from common.cp_checks import check_cp_model, check_cp_size
from common.cp_comms import Ring, Ulysses
from common.cp_costs import cp_start_line, cp_traffic, reset_traffic
from common.cut_check import check_cut, uncut_copy
from common.evaluation import evaluate
from common.launch import make_accelerator, record_peers, run_main
from common.layout import Layout
from common.loader import make_train_loader
from common.metrics import RunMonitor
from common.output_checks import check_resume_and_output, trial_checkpoint
from common.sharded import clip_grad_norm_, shard_loader
from common.sharded_costs import sharded_start_line, sharded_summary
from common.training import StepFeed, compile_units, make_optimizer, make_scheduler


# ======================================== CP: the strategy
class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over the K/V of the whole ring, with the model's
    masks (`window` tokens, `sinks` logits, `softcap`, `documents` ids). Forward: step s attends to
    rank (r - s)'s block while the next one travels; the blocks' outputs merge by their log-sum-exp.
    Backward: the K/V go round again; each block's dK/dV travel with it home to their owner."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, window=None, sinks=None, softcap=None, documents=None):
        B, H, T, D = q.shape
        scale, c = D**-0.5, T // len(ring.chunks_of[ring.rank])  # c: tokens per chunk
        steps = ring_steps(ring.chunks_of, c, window)  # CP: a window may end the ring early
        out = torch.zeros_like(q, dtype=torch.float32)  # merged in fp32, in the layout of q
        lse = torch.full((B, H, T), float("-inf"), dtype=torch.float32, device=q.device)
        kv, computed = torch.stack([k, v]).contiguous(), 0
        for step in range(steps):
            # CP: the next block travels while this one computes
            pending = ring.start_pass(kv, 0, "forward") if step < steps - 1 else None
            blocks = step_blocks(ring.chunks_of, ring.rank, step, c, window, documents)  # CP: masks
            for rows, cols, causal, keep in blocks:
                q_i, k_j, v_j = q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols]
                block_out, block_lse = block_attention(q_i, k_j, v_j, causal, scale, keep, softcap)
                new_lse = torch.logaddexp(lse[:, :, rows], block_lse)  # CP: merge by log-sum-exp
                seen = new_lse.masked_fill(new_lse == float("-inf"), 0.0)  # no key yet: out stays 0
                out[:, :, rows] = (
                    out[:, :, rows] * torch.exp(lse[:, :, rows] - seen)[..., None]
                    + block_out * torch.exp(block_lse - seen)[..., None]
                )
                lse[:, :, rows] = new_lse
            computed += len(blocks)
            if pending is not None:
                kv = Ring.finish(pending)
        ring.count_blocks(computed, blocks_per_rank(ring.chunks_of)[ring.rank])  # the rest: skipped
        if sinks is not None:  # CP: the sink, one more logit of each row, value 0: weights shrink
            out, lse = add_sinks(out, lse, sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks, documents)
        ctx.args = ring, window, softcap, scale, c, steps
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks, documents = ctx.saved_tensors
        ring, window, softcap, scale, c, steps = ctx.args
        dout, dq = dout.contiguous(), torch.zeros_like(q)
        kv, dkv_pending = torch.stack([k, v]).contiguous(), None
        for step in range(steps):
            pending = ring.start_pass(kv, 0, "backward") if step < steps - 1 else None
            dkv = torch.zeros_like(kv)  # CP: K/V round again; this rank's share of their dK, dV
            blocks = step_blocks(ring.chunks_of, ring.rank, step, c, window, documents)
            for rows, cols, causal, keep in blocks:
                q_i, k_j, v_j = q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols]
                out_i, lse_i = out[:, :, rows], lse[:, :, rows].contiguous()  # merged: whole rows
                dqi, dkj, dvj = block_attention_backward(  # CP: the kernel's backward, per block
                    dout[:, :, rows], q_i, k_j, v_j, out_i, lse_i, causal, scale, keep, softcap
                )
                dq[:, :, rows] += dqi
                dkv[0][:, :, cols] += dkj
                dkv[1][:, :, cols] += dvj
            if dkv_pending is not None:  # CP: add the block's dK/dV from the ranks it visited
                dkv += Ring.finish(dkv_pending)
            # CP: dK/dV travel on with their block; after the last step, straight to its owner
            if steps > 1:
                hops = 1 if step < steps - 1 else ring.size - steps + 1
                dkv_pending = ring.start_pass(dkv, 1, "backward", hops)
            if pending is not None:
                kv = Ring.finish(pending)
        dkv = Ring.finish(dkv_pending) if steps > 1 else dkv  # its dK, dV, summed round the ring
        dsinks = None if sinks is None else sinks_grad(dout, out, lse, sinks)  # the rows' sum
        return dq, dkv[0], dkv[1], None, None, dsinks, None, None


def ring_attention(ring: Ring):
    """The attention function the model calls in place of causal SDPA (Task.set_attention): within
    `window` tokens, with `sinks` and soft-capped scores where the model has them."""

    def attention(q, k, v, dropout_p=0.0, window=None, sinks=None, softcap=None, documents=None):
        return RingAttention.apply(q, k, v, ring, window, sinks, softcap, documents)

    attention.ring = ring  # what it sent (the summary)
    return attention


def apply_context_parallel(model, task, layout: Layout, impl: str = "ring", windows=None):
    """Every attention layer becomes the ring or Ulysses' all-to-alls over this rank's CP group;
    returns the attention installed (None at cp 1). `windows` (the layers') may choose the chunks."""
    if layout.cp == 1:
        return None
    chunks_of = cp_chunks(layout.cp, impl, windows, task.tokens_per_sample)
    if impl == "ulysses":
        attention = ulysses_attention(Ulysses(layout.group("cp"), chunks_of))
    else:
        attention = ring_attention(Ring(layout.group("cp"), chunks_of))
    task.set_attention(model, attention)  # CP: the model contract's hook (Task.set_attention)
    return attention


def cp_forward_backward(accelerator, model, micro_batches, n_global_targets, loss_of, grad_scale):
    """Forward and backward of this rank's micro-batches; returns their loss sum: the loss of this
    rank's tokens only (`loss_of`: its chunks of every sequence, attending through the ring or
    Ulysses), normalised by the target count of the whole global batch (all micro-batches, every dp
    and cp rank), so the cp ranks' parts add up to each sequence's loss. FSDP averages the gradients
    over the dp x cp ranks: grad_scale (dp x cp) undoes the average."""
    step_loss_sum = torch.zeros((), device=accelerator.device)
    for mb in micro_batches:
        with accelerator.autocast():  # Accelerate: autocast
            with loss_of(model, mb) as loss_sum:  # CP: the loss of this rank's tokens
                # FSDP averages the gradients over dp x cp ranks: grad_scale undoes it
                accelerator.backward(loss_sum * grad_scale / n_global_targets)
        step_loss_sum += loss_sum.detach()
    return step_loss_sum


def ulysses_attention(ulysses: Ulysses):
    """The attention the model calls in place of causal SDPA: q, k, v to head shards of whole
    sequences, attention with the layer's masks, the output back to this rank's tokens."""

    def attention(q, k, v, dropout_p=0.0, window=None, sinks=None, softcap=None, documents=None):
        q, k, v = (ulysses.seq_to_heads(t) for t in (q, k, v))  # CP: 3 all-to-alls, to heads/cp
        sinks = None if sinks is None else sinks.chunk(ulysses.size)[ulysses.rank]  # its heads'
        out = whole_sequence_attention(q, k, v, window, sinks, softcap, documents)
        return ulysses.heads_to_seq(out)  # CP: the 4th all-to-all: heads/cp -> tokens/cp

    attention.ulysses = ulysses  # what it sent (the summary)
    return attention


def main():
    # ---------------------------------------- flags
    parser = build_parser(__doc__)
    from common.builtin_flags import add_builtin_flags  # the built-in data sets' and models' flags

    add_builtin_flags(parser)  # data and a model of your own: drop these two lines
    g = parser.add_argument_group("context parallel")
    g.add_argument(
        "--cp_size",
        type=int,
        default=-1,
        help="ranks that cut each sequence: all processes (-1); the other factor is data parallel",
    )
    g.add_argument(
        "--cp_impl",
        choices=["ring", "ulysses"],
        default="ring",
        help="ring: K/V travel around the ranks, any head count (sequence divisible by 2 x cp); ulysses: "
        "all-to-alls to head shards and back, fewer bytes, the heads and K/V heads divisible by cp",
    )
    args = parser.parse_args()
    args.output_dir = args.output_dir or "runs/cp"
    check_core_args(args)

    # ---------------------------------------- Accelerator and layout
    # Accelerate: process group (gloo on CPU, NCCL on GPU), device, mixed precision (launcher).
    # cpu=True where CUDA is missing: the N processes then join one gloo group (else each
    # trains alone). The scheduler counts optimizer steps, whatever the layout.
    accelerator = make_accelerator(
        args,
        cpu=args.cpu or not torch.cuda.is_available(),
        sharded=True,  # refuses a launch that also asks Accelerate to shard
        step_scheduler_with_optimizer=False,
    )
    record_peers(accelerator)  # guard: peer records
    check_cp_size(args.cp_size, accelerator.num_processes)  # CP: divides the processes, or -1
    dp_shard = 1 if args.cp_size == -1 else -1  # CP: one ring of all (-1): no data parallel
    layout = Layout.from_degrees(accelerator.num_processes, cp=args.cp_size, dp_shard=dp_shard)
    dp_size = layout.dp  # CP: dp x cp; the CP ranks of one group read the same samples
    grad_accum, global_batch_size = batch_of_step(args, dp_size)  # batch_size x dp x accumulation

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
    units = task.units(model)  # the repeated units: one FSDP unit each, --compile
    n_params, model_line = count_parameters(model), task.describe(model)
    # CP: Task.set_attention and Task.forward_at, or a one-line refusal; what attention receives
    kv_shape = check_cp_model(layout, model, task, args, accelerator.device)
    resume_path, facts = start_point(accelerator, args, model, task, global_batch_size, layout)
    check_resume_and_output(accelerator, args, resume_path, facts)  # guard: output lock
    reference = uncut_copy(model, task, args.skip_cut_check)  # guard: cut check
    layout.build_mesh(accelerator.device.type)

    # ---------------------------------------- CP: the strategy, before the optimizer
    windows = kv_shape["windows"] if kv_shape else None  # CP: the layers' sliding windows
    # CP: every attention layer becomes the ring over the CP group (None: cp 1, nothing to cut)
    attention = apply_context_parallel(model, task, layout, args.cp_impl, windows)
    if args.compile:
        compile_units(units, accelerator)
    # CP: FSDP over dp_shard x cp: the gradients reduce over both (CP ranks hold the same weights)
    if layout.world_size > 1:
        bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        mp_policy = bf16 if accelerator.mixed_precision == "bf16" else MixedPrecisionPolicy()
        for unit in units.children():  # a unit per block, then the root: embeddings, norm, head
            fully_shard(unit, mesh=layout.fsdp_mesh, mp_policy=mp_policy)
        fully_shard(model, mesh=layout.fsdp_mesh, mp_policy=mp_policy, reshard_after_forward=False)
    # CP: the loss of this rank's tokens; FSDP averages the gradients over dp x cp: scaled back
    loss_of = cp_loss(task, layout, accelerator.device, args.cp_impl, windows)
    grad_scale = layout.dp * layout.cp

    # ---------------------------------------- optimizer
    optimizer = make_optimizer(model, args)
    scheduler = make_scheduler(optimizer, args)
    # Accelerate: wraps the optimizer and scheduler (FSDP owns the model); the loader by dp rank
    optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
    train_sampler = train_loader.sampler
    train_loader = shard_loader(train_loader, accelerator, layout)
    whole = plain_attention(task, model, attention) if attention else None  # CP: whole sequences
    check_task_contract(task, model, data.validation, accelerator.device, whole)  # guard: contract
    probe_step = partial(cp_forward_backward, accelerator, model, loss_of=loss_of, grad_scale=grad_scale)
    probe_step.token_positions = getattr(loss_of, "positions", None)  # CP: compared there
    check_cut(accelerator, model, probe_step, reference, task, data.validation, grad_accum, layout)  # guard: cut check
    reset_traffic(attention)  # CP: the summary's bytes are the run's, not the probe's
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
    feed.seed_dropout(args.seed, layout)  # dropout: each dp rank its own masks, a resume the same
    predict = whole_sequence_predict(model, task, attention, layout)  # CP: whole sequences
    monitor = RunMonitor(accelerator, args, "train_cp", feed, layout.world_size, global_batch_size)
    cp_line, formula = cp_start_line(layout, args, task.tokens_per_sample, kv_shape, args.cp_impl)
    costs = sharded_start_line(model, layout, n_params, args.optimizer, accelerator)
    monitor.start(task, model_line, n_params, data, [cp_line, costs], resume_path, layout)

    # ---------------------------------------- the training loop
    step, last_step = progress["step"], min(args.max_steps, args.stop_at_step or args.max_steps)
    model.train()
    while step < last_step and not feed.preempted:
        with monitor.timed_step():  # training time (not the records, evaluations, checkpoints)
            micro_batches, n_global_targets = feed.next_step()
            with monitor.collectives():  # CP: the ring's K/V; FSDP: all-gather, reduce-scatter
                loss_sum = cp_forward_backward(accelerator, model, micro_batches, n_global_targets, loss_of, grad_scale)
            grad_norm = clip_grad_norm_(model.parameters(), args.max_grad_norm)  # the whole model's
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
            scores = evaluate(accelerator, model, task, data.validation, args.eval_batch_size, layout, predict)
            monitor.eval(step, scores)
        if monitor.due(step, "checkpoint") or feed.preempted:  # every rank writes its part
            save_checkpoint(accelerator, args, step, feed, model, optimizer, scheduler, facts)
    feed.close()

    # ---------------------------------------- save
    if step == args.max_steps:  # every rank gathers what it holds; the main process writes
        export_model(accelerator, model, task, data_source(args), Path(args.output_dir) / "model", layout)
    costs = sharded_summary(accelerator, layout, n_params, args.optimizer, model, optimizer)
    costs |= cp_traffic(attention, formula, step - progress["step"])  # CP: measured vs the formula
    monitor.summary(step, preempted=feed.preempted, **costs)
    accelerator.wait_for_everyone()
    accelerator.end_training()  # Accelerate: closes trackers and destroys the process group


if __name__ == "__main__":
    run_main(main)
