#!/usr/bin/env python
"""Context parallelism (CP) with 🤗 Accelerate: ring attention, or Ulysses' all-to-alls, over a
sequence cut into pieces.

Long sequences run out of activation memory before they run out of weights. CP cuts every
sequence over `cp` ranks; each rank runs the whole model on its own tokens. Only attention needs
the others: their keys and values travel around a ring of the CP ranks, one block per step, while a
rank computes on the one it has.

    ring of cp = 4 (forward, one layer): step s, rank r holds the K/V of rank r - s
        rank 0 --K/V--> rank 1 --K/V--> rank 2 --K/V--> rank 3 --K/V--> (rank 0)
        each step: start sending the block on, attend to it (causal, blockwise), merge (log-sum-exp)
    backward: the K/V go round again; each block's dK/dV accumulate on the way home to their owner

    head-tail balancing, 8 chunks of a sequence (2 x cp), causal mask: late tokens see more
        chunk:   0  1  2  3  4  5  6  7
        rank:    0  1  2  3  3  2  1  0     rank r holds chunks r and 2cp-1-r: the same work each

    --cp_impl ulysses (DeepSpeed-Ulysses, the section after the ring's): rank r holds chunk r of
    cp; an all-to-all turns q, k, v (batch, heads, tokens/cp, d) into (batch, heads/cp, tokens, d),
    fused causal SDPA, an all-to-all back: fewer bytes than the ring, none hidden behind compute,
    and the heads must divide by cp. Both honour each layer's sliding window, sinks, soft-capping.

Run it:
    accelerate launch --config_file accelerate_configs/cpu_multi.yaml scripts/train_cp.py \\
        --dataset pystdlib --block_size 1024
    accelerate launch ... --num_processes 4 scripts/train_cp.py --cp_size 2   # dp 2 x cp 2
    accelerate launch ... scripts/train_cp.py --cp_impl ulysses               # all-to-all, no ring
    python scripts/train_cp.py                     # one process: nothing to cut, no ring installed
FSDP shards over dp_shard x cp (torchtitan's dp_shard_cp): CP ranks hold the same weights, and read
the same samples. Lines marked `# CP:` are the strategy; `# Accelerate:` the library's part. Any
model whose Task implements set_attention and forward_at trains under CP (docs/your-model.md).
"""

import sys
from contextlib import contextmanager
from functools import partial
from pathlib import Path

# scripts run as files: copy common/ beside this file
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from accelerate.utils import set_seed
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from common.attention_kernels import (
    block_attention,
    block_attention_backward,
    whole_sequence_attention,
)
from common.checkpoint import check_resume_and_output, export_model, load_checkpoint, save_checkpoint
from common.cli import batch_of_step, build_parser, check_core_args, data_source
from common.costs import count_parameters
from common.cp_checks import check_cp_model, check_cp_size
from common.cp_costs import (
    blocks_per_rank,
    cp_chunks,
    cp_start_line,
    cp_traffic,
    reset_traffic,
    ring_steps,
)
from common.cp_masks import (
    loss_positions,
    plain_attention,
    rank_positions,
    step_blocks,
    whole_sequence_predict,
)
from common.cut_check import check_cut, uncut_copy
from common.evaluation import evaluate
from common.launch import make_accelerator, run_main
from common.layout import Layout
from common.loader import make_train_loader
from common.metrics import RunMonitor
from common.sharded import clip_grad_norm_, shard_loader
from common.sharded_costs import sharded_start_line, sharded_summary
from common.task import check_task_contract
from common.training import StepFeed, compile_units, make_optimizer, make_scheduler


# ======================================== CP: the strategy
class Ring:
    """The ring of one CP group: who sends to whom, which chunks each rank holds, what was sent.
    `overlap=False` waits for each transfer before computing (to measure what the overlap hides)."""

    def __init__(self, group, chunks_of: list[list[int]], overlap: bool = True):
        self.group, self.chunks_of, self.overlap = group, chunks_of, overlap
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.sent_bytes = {"forward": 0, "backward": 0}
        self.blocks_computed = self.blocks_skipped = 0

    def peer(self, hops: int) -> int:
        """The global rank `hops` ranks further round the ring (negative: back)."""
        return dist.get_global_rank(self.group, (self.rank + hops) % self.size)

    def start_pass(self, send: torch.Tensor, tag: int, phase: str, hops: int = 1):
        """Post: send `send` `hops` ranks on, receive the same shape from as far back."""
        recv = torch.empty_like(send)
        ops = [
            dist.P2POp(dist.isend, send, self.peer(hops), self.group, tag),  # CP: both at once
            dist.P2POp(dist.irecv, recv, self.peer(-hops), self.group, tag),
        ]
        works = dist.batch_isend_irecv(ops)
        self.sent_bytes[phase] += send.nbytes
        # overlap=False: wait now, and hand back no work (a gloo work waited twice hangs)
        if not self.overlap:
            for work in works:
                work.wait()
            works = []
        return works, recv

    @staticmethod
    def finish(pending) -> torch.Tensor:
        works, recv = pending
        for work in works:
            work.wait()
        return recv


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over the K/V of the whole ring, with the model's
    masks (`window` tokens, a learned `sinks` logit per head, `softcap`, `documents` ids). Forward:
    step s attends to rank (r - s)'s block while the next one travels; the blocks' outputs merge
    through their log-sum-exp; a sink is one more logit, value 0. Backward: the K/V go round again;
    each block's dK/dV travel with it and reach their owner (or, when a window ends the ring early,
    go straight to it from the last rank)."""

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
        ring.blocks_computed += computed  # the causal ring's other blocks: skipped by the masks
        ring.blocks_skipped += blocks_per_rank(ring.chunks_of)[ring.rank] - computed
        if sinks is not None:  # CP: the sink, one more logit of each row, value 0: weights shrink
            new_lse = torch.logaddexp(lse, sinks.float().view(1, H, 1))
            out, lse = out * torch.exp(lse - new_lse)[..., None], new_lse
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks, documents)
        ctx.ring, ctx.window, ctx.softcap = ring, window, softcap
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks, documents = ctx.saved_tensors
        ring, window, softcap = ctx.ring, ctx.window, ctx.softcap
        T, D = q.shape[2], q.shape[3]
        scale, c = D**-0.5, T // len(ring.chunks_of[ring.rank])
        steps = ring_steps(ring.chunks_of, c, window)
        dout, dq = dout.contiguous(), torch.zeros_like(q)
        kv, dkv_pending = torch.stack([k, v]).contiguous(), None
        for step in range(steps):
            # CP: the K/V go round again
            pending = ring.start_pass(kv, 0, "backward") if step < steps - 1 else None
            dkv = torch.zeros_like(kv)  # this rank's share of the visiting block's dK, dV
            blocks = step_blocks(ring.chunks_of, ring.rank, step, c, window, documents)
            for rows, cols, causal, keep in blocks:
                q_i, k_j, v_j = q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols]
                # merged: the whole rows
                out_i, lse_i = out[:, :, rows], lse[:, :, rows].contiguous()
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
        dsinks = None
        if sinks is not None:  # d out / d sink = -p_sink * out for each row: summed over the rows
            row_dot = (dout.float() * out.float()).sum(-1)
            p_sink = torch.exp(sinks.float().view(1, -1, 1) - lse)
            dsinks = -(p_sink * row_dot).sum((0, 2)).to(sinks.dtype)
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
    returns the attention installed. `windows` (the layers') may choose the chunks (cp_chunks)."""
    chunks_of = cp_chunks(layout.cp, impl, windows, task.tokens_per_sample)
    if impl == "ulysses":
        attention = ulysses_attention(Ulysses(layout.group("cp"), chunks_of))
    else:
        attention = ring_attention(Ring(layout.group("cp"), chunks_of))
    task.set_attention(model, attention)  # CP: the model contract's hook (Task.set_attention)
    return attention


def cp_loss(task, layout: Layout, device, impl: str = "ring", windows=None):
    """`with loss_of(model, mb) as loss_sum:` the loss of this rank's tokens (cp_chunks) at their
    positions, a context its backward runs in; without CP the whole sequence's."""
    if layout.cp == 1:

        @contextmanager
        def whole_sequence_loss(model, mb):
            yield task.loss_of(model, mb)[0]

        return whole_sequence_loss
    # CP: this rank's tokens (its chunks, the same positions in every sequence) and their targets
    chunks_of = cp_chunks(layout.cp, impl, windows, task.tokens_per_sample)
    n_chunks = sum(map(len, chunks_of))
    positions = rank_positions(task.tokens_per_sample, chunks_of[layout.cp_rank], n_chunks, device)

    @contextmanager
    def ring_loss(model, mb):
        ids, targets = task.inputs(mb)[0][:, positions], task.next_token_targets(mb)[:, positions]
        # CP: at their positions (--document_mask: in each document, and the documents)
        yield task.loss_at(model, ids, targets, *loss_positions(mb, positions))[0]

    ring_loss.positions = positions  # the cut check compares outputs at these positions
    return ring_loss


def cp_forward_backward(
    accelerator, model, micro_batches: list, n_global_targets, loss_of, grad_scale: int
) -> torch.Tensor:
    """Forward and backward of this rank's tokens of every sequence; returns their loss sum. FSDP
    averages gradients over the dp x cp ranks: `grad_scale` (their number) scales back, so the
    gradient is that of (global loss sum / global targets)."""
    step_loss_sum = torch.zeros((), device=accelerator.device)
    for mb in micro_batches:
        with accelerator.autocast():  # Accelerate: autocast
            with loss_of(model, mb) as loss_sum:  # CP: the loss of this rank's tokens
                accelerator.backward(loss_sum * grad_scale / n_global_targets)
        step_loss_sum += loss_sum.detach()
    return step_loss_sum


# ---------------------------------------- CP: Ulysses, the other way to cut the sequence
class AllToAll(torch.autograd.Function):
    """all_to_all_single over the CP group: piece j of dim 0 goes to rank j, piece j of the result
    came from rank j; backward exchanges the gradient the same way."""

    @staticmethod
    def forward(ctx, x, ulysses):
        ctx.ulysses = ulysses
        return ulysses.exchange(x, "forward")

    @staticmethod
    def backward(ctx, grad):
        return ctx.ulysses.exchange(grad, "backward"), None


class Ulysses:
    """The all-to-alls of one CP group: which chunks each rank holds, what was sent (the buffers
    handed to all_to_all_single; (cp-1)/cp of each leaves the rank)."""

    def __init__(self, group, chunks_of: list[list[int]]):
        self.group, self.chunks_of = group, chunks_of
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        # the chunks in the order the all-to-all brings them
        gathered = [c for chunks in chunks_of for c in chunks]
        self.back = torch.tensor(gathered)  # sequence -> that order
        self.to_sequence = torch.argsort(self.back)  # that order -> the sequence's
        self.in_order = gathered == sorted(gathered)
        self.sent_bytes = {"forward": 0, "backward": 0}

    def exchange(self, x: torch.Tensor, phase: str) -> torch.Tensor:
        x = x.contiguous()
        self.sent_bytes[phase] += x.nbytes
        exchanged = funcol.all_to_all_single(x, None, None, self.group)  # CP: the all-to-all
        return funcol.wait_tensor(exchanged)

    def seq_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, heads, tokens/cp, d) -> (batch, heads/cp, tokens, d): whole sequences."""
        B, H, T, D = x.shape
        n = len(self.chunks_of[self.rank])  # chunks per rank
        # piece j: the heads for rank j; back (CP): (B, H/cp, rank, T, D), rank j's tokens
        pieces = x.reshape(B, self.size, H // self.size, T, D).transpose(0, 1)
        x = AllToAll.apply(pieces, self).permute(1, 2, 0, 3, 4)
        x = x.reshape(B, H // self.size, self.size * n, T // n, D)  # chunks, in rank order
        if not self.in_order:  # CP: the chunks back in the sequence's order
            x = x.index_select(2, self.to_sequence.to(x.device))
        return x.reshape(B, H // self.size, self.size * T, D)

    def heads_to_seq(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, heads/cp, tokens, d) -> (batch, heads, tokens/cp, d): this rank's tokens."""
        B, h, S, D = x.shape
        n = len(self.chunks_of[self.rank])
        x = x.reshape(B, h, self.size * n, S // (self.size * n), D)
        if not self.in_order:
            x = x.index_select(2, self.back.to(x.device))
        # piece j: rank j's tokens
        pieces = x.reshape(B, h, self.size, S // self.size, D).permute(2, 0, 1, 3, 4)
        x = AllToAll.apply(pieces, self)  # CP: piece j: heads of rank j, for this rank's tokens
        return x.transpose(0, 1).reshape(B, self.size * h, S // self.size, D)


def ulysses_attention(ulysses: Ulysses):
    """The attention the model calls in place of causal SDPA (Task.set_attention): q, k, v to head
    shards of whole sequences, attention with the layer's masks, the output back to this rank's."""

    def attention(q, k, v, dropout_p=0.0, window=None, sinks=None, softcap=None, documents=None):
        q, k, v = (ulysses.seq_to_heads(t) for t in (q, k, v))  # CP: 3 all-to-alls, to heads/cp
        h = q.shape[1]  # this rank's heads: h x rank .. h x (rank + 1) of the model's
        sinks = None if sinks is None else sinks[h * ulysses.rank : h * (ulysses.rank + 1)]
        out = whole_sequence_attention(q, k, v, window, sinks, softcap, documents)
        return ulysses.heads_to_seq(out)  # CP: the 4th all-to-all: heads/cp -> tokens/cp

    attention.ulysses = ulysses  # what it sent (the summary)
    return attention


CP_SIZE_HELP = "ranks that cut each sequence: all processes (-1); the other factor is data parallel"
CP_IMPL_HELP = (
    "ring: K/V travel around the ranks, any head count (sequence divisible by 2 x cp); ulysses: an "
    "all-to-all turns sequence shards into head shards, fused attention on whole sequences, an "
    "all-to-all back: fewer bytes (half the ring's at cp 2), but the heads (and K/V heads) must "
    "divide by cp; both honour each layer's sliding window, sinks and soft-capping (docs/cp.md)"
)


def main():
    # ---------------------------------------- flags
    parser = build_parser(__doc__)
    from common.builtin_flags import add_builtin_flags  # the built-in data sets' and models' flags

    add_builtin_flags(parser)  # data and a model of your own: drop these two lines
    g = parser.add_argument_group("context parallel")
    g.add_argument("--cp_size", type=int, default=-1, help=CP_SIZE_HELP)
    g.add_argument("--cp_impl", choices=["ring", "ulysses"], default="ring", help=CP_IMPL_HELP)
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
    # micro-batch's (loss_sum, n_targets), its evaluation and export (docs/your-model.md) CP: and
    # its attention, replaceable (Task.set_attention), a forward at positions (Task.forward_at)
    from common.model import language_model

    model, task = language_model(args, data)
    model = model.to(accelerator.device)
    units = task.units(model)  # the repeated units: one FSDP unit each, --compile
    n_params, model_line = count_parameters(model), task.describe(model)
    # CP: a model without them is refused, one line; what its attention receives (heads, windows)
    kv_shape = check_cp_model(layout, model, task, args, accelerator.device)
    resume_path, facts = check_resume_and_output(accelerator, args, model, task, global_batch_size, layout)
    reference = uncut_copy(model, task, args.skip_cut_check)  # what the cut must compute
    layout.build_mesh(accelerator.device.type)

    # ---------------------------------------- CP: the strategy
    windows = kv_shape["windows"] if kv_shape else None  # CP: the layers' sliding windows
    attention = None
    if layout.cp > 1:  # CP: every attention layer becomes the ring over the CP group
        attention = apply_context_parallel(model, task, layout, args.cp_impl, windows)
    if args.compile:
        compile_units(units, accelerator)
    # CP: FSDP over dp_shard x cp: the gradients reduce over both (CP ranks hold the same weights)
    if layout.world_size > 1:
        mp_policy = MixedPrecisionPolicy()  # fp32; bf16: bf16 compute, fp32 reduction
        if accelerator.mixed_precision == "bf16":
            mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for unit in units.children():  # a unit per block, then the root: embeddings, norm, head
            fully_shard(unit, mesh=layout.fsdp_mesh, mp_policy=mp_policy)
        fully_shard(model, mesh=layout.fsdp_mesh, mp_policy=mp_policy, reshard_after_forward=False)
    # CP: the loss of this rank's tokens; FSDP averages the gradients over dp x cp: scaled back
    loss_of = cp_loss(task, layout, accelerator.device, args.cp_impl, windows)
    grad_scale = layout.dp * layout.cp

    # ---------------------------------------- optimizer (after sharding: it sees the shards)
    optimizer = make_optimizer(model, args)
    scheduler = make_scheduler(optimizer, args)
    # Accelerate: wraps the optimizer and scheduler (FSDP owns the model); the loader by dp rank
    optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
    train_sampler = train_loader.sampler
    train_loader = shard_loader(train_loader, accelerator, layout)
    whole = plain_attention(task, model, attention) if attention else None  # CP: whole sequences
    check_task_contract(task, model, data.validation, accelerator.device, whole)
    probe_step = partial(cp_forward_backward, accelerator, model, loss_of=loss_of, grad_scale=grad_scale)
    probe_step.token_positions = getattr(loss_of, "positions", None)  # CP: compared there
    cut_line = check_cut(accelerator, model, probe_step, reference, task, data.validation, grad_accum, layout)
    reset_traffic(attention)  # CP: the summary's bytes are the run's, not the probe's
    progress = load_checkpoint(accelerator, resume_path, model, optimizer, scheduler)  # or step 0
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
    monitor.start(task, model_line, n_params, data, [cp_line, costs, cut_line], resume_path, layout)

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

        if monitor.due(step, "train"):  # CP: each rank's loss of its tokens; the sum: the batch's
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
    if attention:  # CP: the run's measured traffic beside the formula's
        costs |= cp_traffic(attention, formula, step - progress["step"])
    monitor.summary(step, preempted=feed.preempted, **costs)
    accelerator.wait_for_everyone()
    accelerator.end_training()  # Accelerate: closes trackers and destroys the process group


if __name__ == "__main__":
    run_main(main)
