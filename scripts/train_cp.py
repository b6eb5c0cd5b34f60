#!/usr/bin/env python
"""Context parallelism (CP): ring attention or Ulysses' all-to-all over a sequence cut into pieces, under 🤗 Accelerate.

Long sequences run out of activation memory before they run out of weights: every layer keeps
activations of size batch x tokens x width. CP cuts every sequence over `cp` ranks; each rank runs
the whole model on its own tokens. Only attention needs the other tokens: their keys and values
travel around a ring of the CP ranks, one block per step, while this rank computes on the block it has.

    ring of cp = 4 (forward, one layer): step s, rank r holds the K/V of rank r - s
        rank 0 --K/V--> rank 1 --K/V--> rank 2 --K/V--> rank 3 --K/V--> (rank 0)
        each step: start sending the block on, attend to it (causal, blockwise), merge by log-sum-exp
    backward: the K/V go round again, and each block's dK/dV accumulate on the way home to their owner

    head-tail balancing, 8 chunks of a sequence (2 x cp), causal mask: late tokens see more
        chunk:   0  1  2  3  4  5  6  7
        rank:    0  1  2  3  3  2  1  0     rank r holds chunks r and 2cp-1-r: every rank the same work

    --cp_impl ulysses (DeepSpeed-Ulysses): rank r holds chunk r of cp; in every layer an all-to-all turns
    q, k, v (batch, heads, tokens/cp, d) into (batch, heads/cp, tokens, d): whole sequences, cp-th of the
    heads; fused causal SDPA; an all-to-all brings the output back. 4 all-to-alls forward, 4 backward,
    each b x s/cp x d per rank, (cp-1)/cp of it sent: half the ring's bytes at cp 2, 3/10 at cp 4, but
    not hidden behind compute, and the heads must divide by cp.

    masks (both): each layer's sliding window (a block whole, cropped with a mask, or skipped; steps no rank
    needs are not sent), learned sinks (one more logit of the log-sum-exp), soft-capped scores (plain matmuls)

Run it:
    accelerate launch --config_file accelerate_configs/cpu_multi.yaml scripts/train_cp.py \\
        --dataset pystdlib --block_size 1024
    accelerate launch ... --num_processes 4 scripts/train_cp.py --cp_size 2   # dp 2 x cp 2 (FSDP over all 4)
    accelerate launch ... scripts/train_cp.py --cp_impl ulysses               # all-to-all instead of the ring
    python scripts/train_cp.py                     # one process: nothing to cut, the ring is not installed
Gradients reduce over dp x cp (CP ranks hold the same weights): FSDP shards over the flattened
dp_shard x cp mesh, as torchtitan's dp_shard_cp. Data parallel beside CP shards the data by the dp
coordinate only: every rank of a CP group reads the same samples. Lines marked `# CP:` are the
strategy; `# Accelerate:` the library's part. Any model whose Task implements Task.set_attention and
Task.forward_at trains under CP: the built-in GPT, the 🤗 families (through transformers'
AttentionInterface), a model of your own (docs/your-model.md).
"""

import sys
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts run as files: copy common/ beside this file

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from accelerate.utils import set_seed
from torch.distributed.fsdp import FSDPModule

from common.causal_lm import documents_of
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
from common.sharded import clip_grad_norm_, shard_loader
from common.sharded_costs import sharded_start_line, sharded_summary, ulysses_bytes_per_layer
from common.task import check_task_contract
from common.training import StepFeed, compile_units, make_optimizer, make_scheduler
from train_fsdp import apply_fsdp


# ======================================== CP: the strategy
def attention_shapes(task, model, device) -> dict:
    """What CP carries, measured on the model through the contract alone (Task.set_attention,
    Task.forward_at): one forward of 2 tokens with a recording attention in every layer gives the query and
    K/V heads and widths as the attention receives them (heads x head_dim; grouped KV heads may arrive
    repeated), the layers that call it and each one's sliding window (None: the whole past): the ring's and
    Ulysses' bytes, the ring's chunks, and Ulysses' head check."""
    seen, windows = [], []

    def recording_attention(q, k, v, dropout_p=0.0, window=None, sinks=None, softcap=None, documents=None):
        kv_width = (k.shape[1] * k.shape[-1] + v.shape[1] * v.shape[-1]) / 2
        seen.append((q.shape[1], k.shape[1], q.shape[1] * q.shape[-1], kv_width))
        windows.append(window)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])

    was_training = model.training
    model.eval()
    task.set_attention(model, recording_attention)
    try:
        with torch.no_grad():
            task.forward_at(model, torch.zeros(1, 2, dtype=torch.long, device=device), torch.arange(2, device=device))
    finally:
        task.set_attention(model, None)
        model.train(was_training)
    q_heads, kv_heads, q_width, width = seen[0] if seen else (0, 0, 0, 0)
    shapes = {"q_heads": q_heads, "kv_heads": kv_heads, "q_width": q_width, "width": width, "layers": len(seen)}
    return shapes | {"windows": windows}


def head_tail_chunks(cp: int) -> list[list[int]]:
    """Which chunks of a sequence cut into 2 x cp each rank holds: rank r holds r and 2cp-1-r."""
    return [[r, 2 * cp - 1 - r] for r in range(cp)]


def contiguous_chunks(cp: int) -> list[list[int]]:
    """Without balancing: rank r holds chunk r of cp (picotron's split). Under a causal mask rank r
    then computes r + 1 blocks, rank cp - 1 all cp of them."""
    return [[r] for r in range(cp)]


def rank_positions(seq_len: int, chunks: list[int], n_chunks: int, device=None) -> torch.Tensor:
    """The real positions, in the sequence, of a rank's tokens: its chunks, in order."""
    size = seq_len // n_chunks
    return torch.cat([torch.arange(c * size, (c + 1) * size, device=device) for c in chunks])


def causal_blocks(q_chunks: list[int], kv_chunks: list[int]) -> list[tuple[int, int, bool]]:
    """The (q chunk, kv chunk) pairs a causal mask leaves something to compute: a kv chunk after the
    q chunk is skipped, the same chunk is a causal (diagonal) block, an earlier one a full block.
    Returns (index of the q chunk in q_chunks, index of the kv chunk in kv_chunks, is_diagonal)."""
    return [(i, j, qc == kc) for i, qc in enumerate(q_chunks) for j, kc in enumerate(kv_chunks) if kc <= qc]


def blocks_per_rank(chunks_of: list[list[int]]) -> list[int]:
    """The attention blocks (q chunk x kv chunk, a diagonal one counted whole) each rank computes over
    a whole ring: what head-tail balancing evens out."""
    return [sum(len(causal_blocks(mine, theirs)) for theirs in chunks_of) for mine in chunks_of]


# ---------------------------------------- CP: the masks a block can carry
#   A sliding window of W tokens (Mistral, Gemma 3's sliding layers, gpt-oss's): a query at position p sees the keys
#   at p - W < j <= p. In blocks of c x c tokens, a (q chunk, kv chunk) pair d = (qc - kc) x c positions apart is
#   whole (every offset d - c + 1 .. d + c - 1 inside the window), empty (none inside: neither computed nor, when
#   no rank needs a step of the ring any more, sent), or cropped to the rows and columns that see something, with
#   a mask of what inside them is kept:
#       W = 6, c = 4, d = 4 (the chunk just before):   rows 0-4 see cols 0-3 as  . x x x  (x: kept)
#                                                                                 . . x x
#                                                                                 . . . x   (row 3: only col 3)
#                                                                                 . . . .   <- not computed
def masked_blocks(q_chunks: list[int], kv_chunks: list[int], c: int, window: int | None) -> list[tuple]:
    """The blocks of `q_chunks` x `kv_chunks` (chunks of c tokens) a causal mask within `window` tokens (None:
    the whole past) leaves something in: (index of the q chunk, of the kv chunk, rows, cols, causal, keep):
    `rows`/`cols` slice the block, `causal` is a whole diagonal block, `keep` a bool mask of (rows, cols) or None."""
    blocks = []
    for i, qc in enumerate(q_chunks):
        for j, kc in enumerate(kv_chunks):
            d = (qc - kc) * c  # the offset of row 0 from col 0: a row a sees col b at offset d + a - b
            if d < 0 or (window is not None and d - (c - 1) >= window):
                continue  # after the query chunk, or wholly outside the window
            if window is None or d + c - 1 < window:
                blocks.append((i, j, slice(0, c), slice(0, c), d == 0, None))
                continue
            rows, cols = torch.arange(min(c, window + c - 1 - d))[:, None], torch.arange(max(0, d - window + 1), c)
            offset = d + rows - cols[None]
            keep = (offset >= 0) & (offset < window)
            blocks.append((i, j, slice(0, rows.shape[0]), slice(int(cols[0]), c), False, keep))
    return blocks


def document_blocks(blocks: list[tuple], q_chunks: list[int], kv_chunks: list[int], c: int, documents) -> list[tuple]:
    """masked_blocks' blocks with the document mask (--document_mask) on top: a query sees only keys of its own
    document. `documents`: (batch, tokens) ids of the whole sequences. A block no sequence keeps anything of is
    dropped (not computed); one kept whole stays unmasked; the others carry a (batch, 1, rows, cols) mask."""
    if documents is None:
        return blocks
    kept = []
    for i, j, rows, cols, causal, keep in blocks:
        q0, k0 = q_chunks[i] * c, kv_chunks[j] * c  # the chunks' first positions in the sequence
        same = (
            documents[:, q0 + rows.start : q0 + rows.stop, None] == documents[:, None, k0 + cols.start : k0 + cols.stop]
        )[:, None]
        if causal:
            keep = torch.ones(same.shape[-2:], dtype=torch.bool, device=same.device).tril()
        mask = same if keep is None else same & keep.to(same.device)
        if not mask.any():
            continue  # CP: every query of the block is in another document than every key
        if keep is None and mask.all():
            kept.append((i, j, rows, cols, causal, None))
        else:
            kept.append((i, j, rows, cols, False, mask))
    return kept


def ring_steps(chunks_of: list[list[int]], c: int, window: int | None) -> int:
    """How many steps of the ring some rank computes something in: the ring stops after them (the K/V a
    window leaves unneeded are not sent). Every step without a window."""
    size = len(chunks_of)
    needed = [s for s in range(size) for r in range(size) if masked_blocks(chunks_of[r], chunks_of[r - s], c, window)]
    return max(needed) + 1


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
        """Post: send `send` `hops` ranks on (the next one), receive the same shape from as far back."""
        recv = torch.empty_like(send)
        ops = [
            dist.P2POp(dist.isend, send, self.peer(hops), self.group, tag),  # CP: point-to-point, both at once
            dist.P2POp(dist.irecv, recv, self.peer(-hops), self.group, tag),
        ]
        works = dist.batch_isend_irecv(ops)
        self.sent_bytes[phase] += send.nbytes
        if not self.overlap:  # wait now (a gloo work waited twice hangs: hand back none to wait for)
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


# ---------------------------------------- CP: one block of the ring, the fused kernel that returns the log-sum-exp
#   The kernel PyTorch's own ring attention calls, chosen by device: on CPUs the flash kernel for CPUs, a cropped
#   window block's mask given as an additive float mask; on CUDA flash (fp16/bf16) or memory-efficient (fp32).
#   Plain matmuls (a materialised score matrix) remain where no kernel takes the scores: soft-capped ones
#   (Gemma 2), and a cropped window block on CUDA.
def _cuda_flash(q) -> bool:
    return q.dtype in (torch.float16, torch.bfloat16)


def _plain(q, keep, softcap) -> bool:
    return softcap is not None or (q.is_cuda and keep is not None)


def _scores(q, k, scale: float, causal: bool, keep, softcap):
    """The block's scores in fp32 as the model computes them (soft-capped, masked), and the uncapped tanh."""
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    capped = None
    if softcap is not None:
        capped = torch.tanh(scores / softcap)
        scores = softcap * capped
    if causal:
        keep = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    if keep is not None:
        scores = scores.masked_fill(~keep.to(q.device), float("-inf"))
    return scores, capped


def block_attention(q, k, v, causal: bool, scale: float, keep=None, softcap=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the query rows `q` over one K/V block: its output and the log-sum-exp of every row,
    (batch, heads, rows) fp32 contiguous. `causal`: a diagonal block (a chunk over its own keys); `keep`: the
    bool mask of a cropped window block ((rows, cols), or (batch, 1, rows, cols) with documents); `softcap`:
    scores soft-capped as softcap * tanh(s / softcap)."""
    aten = torch.ops.aten
    if _plain(q, keep, softcap):
        scores, _ = _scores(q, k, scale, causal, keep, softcap)
        lse = scores.logsumexp(-1)  # -inf on a row that sees no key here (another document): its weights are 0
        return (torch.exp(scores - lse[..., None]).nan_to_num(0.0) @ v.float()).to(q.dtype), lse.contiguous()
    if not q.is_cuda:
        mask = None if keep is None else torch.zeros(keep.shape, dtype=q.dtype).masked_fill(~keep, float("-inf"))
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
        if keep is not None and keep.dim() == 4:  # a row of another document than every key: the kernel says lse 0
            lse = lse.masked_fill(~keep.any(-1), float("-inf"))
    elif _cuda_flash(q):
        out, lse, *_ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=scale)
    else:
        out, lse, *_ = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
        lse = lse[..., : q.shape[2]]  # its rows come padded to a multiple of 32
    return out, lse.float().contiguous()  # the CPU kernel's is laid out (batch, rows, heads)


def block_attention_backward(dout, q, k, v, out, lse, causal: bool, scale: float, keep=None, softcap=None):
    """dq, dk, dv of one block, given the MERGED output and log-sum-exp of its rows (over every block they
    attend to, and the sink): the kernel's exp(S - lse) is then this block's share of the whole row's softmax,
    and its rowsum(dO * O) the whole row's, so the block's gradients are exact parts of the whole."""
    aten = torch.ops.aten
    if _plain(q, keep, softcap):  # flash attention's backward, written out
        scores, capped = _scores(q, k, scale, causal, keep, softcap)
        p = torch.exp(scores - lse[..., None])
        dv = p.transpose(-1, -2) @ dout.float()
        ds = p * (dout.float() @ v.float().transpose(-1, -2) - (dout.float() * out.float()).sum(-1, keepdim=True))
        if capped is not None:
            ds = ds * (1 - capped**2)  # through softcap * tanh(s / softcap)
        return (
            (ds @ k.float() * scale).to(q.dtype),
            (ds.transpose(-1, -2) @ q.float() * scale).to(k.dtype),
            dv.to(v.dtype),
        )
    if not q.is_cuda:
        mask = None if keep is None else torch.zeros(keep.shape, dtype=q.dtype).masked_fill(~keep, float("-inf"))
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale
        )
    no_rng = torch.empty((), dtype=torch.long)  # dropout's seed and offset: what the kernels return without dropout
    if _cuda_flash(q):
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, no_rng, no_rng, scale=scale
        )
    lse = F.pad(lse, (0, -lse.shape[-1] % 32))  # the efficient kernel's layout: rows padded to a multiple of 32
    grads = aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, lse, no_rng, no_rng, 0.0, [True, True, True, False], causal, scale=scale
    )
    return grads[:3]


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over the keys/values of the whole ring, within `window` tokens
    (None: the whole past), with a learned sink logit per head (`sinks`, gpt-oss) and soft-capped scores; with
    `documents` ((batch, tokens): the whole sequences' ids, --document_mask) within each query's document.

    Forward: step s attends to the K/V block of rank (r - s) while the next block travels; each block is one
    fused kernel call (block_attention) returning its output and log-sum-exp, and the partial outputs merge
    through the log-sum-exp (flash attention's online softmax); a sink joins the merge as one more logit with
    a zero value. Backward: the K/V go round again; each block is the kernel's backward with the merged output
    and log-sum-exp of its rows; dK/dV of each block accumulate on every rank it visits and reach their owner
    after cp passes (or, when a window ends the ring early, straight from the last rank); each pass overlaps
    the next block's compute."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, window=None, sinks=None, softcap=None, documents=None):
        B, H, T, D = q.shape
        scale = D**-0.5
        mine = ring.chunks_of[ring.rank]
        c = T // len(mine)
        steps = ring_steps(ring.chunks_of, c, window)  # CP: a window may leave the last steps unneeded
        out = torch.zeros_like(q, dtype=torch.float32)  # merged in fp32, in the layout of q (the model transposes it)
        lse = torch.full((B, H, T), float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        for step in range(steps):
            source = (ring.rank - step) % ring.size
            pending = ring.start_pass(kv, 0, "forward") if step < steps - 1 else None  # CP: next block travels
            blocks = masked_blocks(mine, ring.chunks_of[source], c, window)  # CP: ... while this one computes
            blocks = document_blocks(blocks, mine, ring.chunks_of[source], c, documents)  # CP: and its documents
            for i, j, rows, cols, causal, keep in blocks:
                rows, cols = slice(i * c + rows.start, i * c + rows.stop), slice(j * c + cols.start, (j + 1) * c)
                block_out, block_lse = block_attention(
                    q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], causal, scale, keep, softcap
                )
                new_lse = torch.logaddexp(lse[:, :, rows], block_lse)  # CP: merge by log-sum-exp
                seen = new_lse.masked_fill(new_lse == float("-inf"), 0.0)  # a row with no key yet keeps out 0
                out[:, :, rows] = (
                    out[:, :, rows] * torch.exp(lse[:, :, rows] - seen)[..., None]
                    + block_out * torch.exp(block_lse - seen)[..., None]
                )
                lse[:, :, rows] = new_lse
            ring.blocks_computed += len(blocks)
            ring.blocks_skipped += len(causal_blocks(mine, ring.chunks_of[source])) - len(blocks)  # the window's
            if pending is not None:
                kv = Ring.finish(pending)
        for step in range(steps, ring.size):  # the steps the ring no longer takes: their blocks skipped too
            ring.blocks_skipped += len(causal_blocks(mine, ring.chunks_of[(ring.rank - step) % ring.size]))
        if sinks is not None:  # CP: the sink, one more logit of every row, its value zero: only the weights shrink
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
        scale = D**-0.5
        mine = ring.chunks_of[ring.rank]
        c = T // len(mine)
        steps = ring_steps(ring.chunks_of, c, window)
        dout = dout.contiguous()
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v]).contiguous()
        dkv_pending = None
        for step in range(steps):
            source = (ring.rank - step) % ring.size
            pending = ring.start_pass(kv, 0, "backward") if step < steps - 1 else None  # CP: K/V again
            dkv = torch.zeros_like(kv)  # this rank's share of the visiting block's dK, dV
            blocks = masked_blocks(mine, ring.chunks_of[source], c, window)
            for i, j, rows, cols, causal, keep in document_blocks(blocks, mine, ring.chunks_of[source], c, documents):
                rows, cols = slice(i * c + rows.start, i * c + rows.stop), slice(j * c + cols.start, (j + 1) * c)
                dqi, dkj, dvj = block_attention_backward(  # CP: the kernel's backward, the rows' merged out and lse
                    dout[:, :, rows],
                    q[:, :, rows],
                    kv[0][:, :, cols],
                    kv[1][:, :, cols],
                    out[:, :, rows],
                    lse[:, :, rows].contiguous(),
                    causal,
                    scale,
                    keep,
                    softcap,
                )
                dq[:, :, rows] += dqi
                dkv[0][:, :, cols] += dkj
                dkv[1][:, :, cols] += dvj
            if dkv_pending is not None:  # CP: the block's dK/dV so far, from the ranks it visited before
                dkv += Ring.finish(dkv_pending)
            if steps > 1:  # CP: dK/dV travel on with their block; after the last step, straight to its owner
                dkv_pending = ring.start_pass(dkv, 1, "backward", 1 if step < steps - 1 else ring.size - steps + 1)
            if pending is not None:
                kv = Ring.finish(pending)
        dkv = Ring.finish(dkv_pending) if steps > 1 else dkv  # this rank's own dK, dV, summed over the ring
        dsinks = None
        if sinks is not None:  # d out / d sink = -p_sink * out for every row: summed over this rank's rows
            row_dot = (dout.float() * out.float()).sum(-1)
            dsinks = -(torch.exp(sinks.float().view(1, -1, 1) - lse) * row_dot).sum((0, 2)).to(sinks.dtype)
        return dq, dkv[0], dkv[1], None, None, dsinks, None, None


def ring_attention(ring: Ring):
    """The attention function the model calls in place of causal SDPA (Task.set_attention): within `window`
    tokens, with `sinks` and soft-capped scores where the model has them."""

    def attention(q, k, v, dropout_p: float = 0.0, window=None, sinks=None, softcap=None, documents=None):
        return RingAttention.apply(q, k, v, ring, window, sinks, softcap, documents)

    attention.ring = ring  # what it sent (the summary)
    return attention


# ---------------------------------------- CP: Ulysses, the other way to cut the sequence
#   (DeepSpeed-Ulysses; the Ultra-Scale Playbook). cp = 2, 4 heads, rank r holds chunk r of the tokens:
#       before attention    rank 0: tokens 0..T/2, heads 0-3     rank 1: tokens T/2..T, heads 0-3
#       all-to-all (q, k, v: send heads j to rank j)
#       attention           rank 0: tokens 0..T,   heads 0-1     rank 1: tokens 0..T,   heads 2-3
#       all-to-all back (the output: send tokens of rank j to rank j)
class AllToAll(torch.autograd.Function):
    """all_to_all_single over the CP group: dim 0 of `x` is cut into cp pieces, piece j goes to rank j, and
    piece j of the result came from rank j. Its backward is the same exchange of the gradient (what came
    from rank j goes back to it). Gloo has all_to_all_single; the functional collective (what the run's
    collective counter sees) is waited for here."""

    @staticmethod
    def forward(ctx, x, ulysses):
        ctx.ulysses = ulysses
        return ulysses.exchange(x, "forward")

    @staticmethod
    def backward(ctx, grad):
        return ctx.ulysses.exchange(grad, "backward"), None


class Ulysses:
    """The all-to-alls of one CP group: which chunks of a sequence each rank holds, what was sent (the
    buffers each rank hands to all_to_all_single; (cp-1)/cp of each leaves the rank)."""

    def __init__(self, group, chunks_of: list[list[int]]):
        self.group, self.chunks_of = group, chunks_of
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        gathered = [c for chunks in chunks_of for c in chunks]  # the chunks in the order the all-to-all brings
        self.back = torch.tensor(gathered)  # sequence -> that order
        self.to_sequence = torch.argsort(self.back)  # that order -> the sequence's (identity for chunk r of cp)
        self.in_order = gathered == sorted(gathered)
        self.sent_bytes = {"forward": 0, "backward": 0}

    def exchange(self, x: torch.Tensor, phase: str) -> torch.Tensor:
        x = x.contiguous()
        self.sent_bytes[phase] += x.nbytes
        return funcol.wait_tensor(funcol.all_to_all_single(x, None, None, self.group))  # CP: all-to-all

    def seq_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, heads, tokens/cp, d), this rank's tokens -> (batch, heads/cp, tokens, d), the whole sequence."""
        B, H, T, D = x.shape
        n = len(self.chunks_of[self.rank])  # chunks per rank
        pieces = x.reshape(B, self.size, H // self.size, T, D).transpose(0, 1)  # piece j: heads for rank j
        x = AllToAll.apply(pieces, self).permute(1, 2, 0, 3, 4)  # CP: (B, H/cp, rank, T, D): rank j's tokens
        x = x.reshape(B, H // self.size, self.size * n, T // n, D)  # in chunks, in the order of the ranks
        if not self.in_order:  # CP: the chunks back in the sequence's order
            x = x.index_select(2, self.to_sequence.to(x.device))
        return x.reshape(B, H // self.size, self.size * T, D)

    def heads_to_seq(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, heads/cp, tokens, d) -> (batch, heads, tokens/cp, d): this rank's tokens, every head."""
        B, h, S, D = x.shape
        n = len(self.chunks_of[self.rank])
        x = x.reshape(B, h, self.size * n, S // (self.size * n), D)
        if not self.in_order:
            x = x.index_select(2, self.back.to(x.device))
        pieces = x.reshape(B, h, self.size, S // self.size, D).permute(2, 0, 1, 3, 4)  # piece j: rank j's tokens
        x = AllToAll.apply(pieces, self)  # CP: piece j: heads of rank j, for this rank's tokens
        return x.transpose(0, 1).reshape(B, self.size * h, S // self.size, D)


def ulysses_attention(ulysses: Ulysses):
    """The attention function the model calls in place of causal SDPA (Task.set_attention): q, k, v to head
    shards of whole sequences, the fused kernel (a window as its mask), the output back to this rank's tokens.
    Sinks and soft-capped scores, which no fused kernel takes, are computed as plain matmuls."""

    def attention(q, k, v, dropout_p: float = 0.0, window=None, sinks=None, softcap=None, documents=None):
        q, k, v = (ulysses.seq_to_heads(t) for t in (q, k, v))  # CP: 3 all-to-alls: tokens/cp -> heads/cp
        h = q.shape[1]  # this rank's heads: h x rank .. h x (rank + 1) of the model's
        sinks = None if sinks is None else sinks[h * ulysses.rank : h * (ulysses.rank + 1)]
        out = whole_sequence_attention(q, k, v, window, sinks, softcap, documents)
        return ulysses.heads_to_seq(out)  # CP: the 4th all-to-all: heads/cp -> tokens/cp

    attention.ulysses = ulysses  # what it sent (the summary)
    return attention


def whole_sequence_attention(q, k, v, window=None, sinks=None, softcap=None, documents=None):
    """Causal attention over whole sequences, within `window` tokens and each token's document (`documents`,
    (batch, tokens) ids): fused SDPA (the mask as a bool mask); with sinks or soft-capping, the scores written
    out (the sink one more column, dropped after the softmax)."""
    T, gqa = q.shape[2], k.shape[1] != q.shape[1]
    offset = torch.arange(T, device=q.device)[:, None] - torch.arange(T, device=q.device)
    keep = (offset >= 0) & (offset < (window or T))
    if documents is not None:
        keep = keep & (documents[:, None, :, None] == documents[:, None, None, :])  # (batch, 1, T, T)
    if sinks is None and softcap is None:
        if documents is None and (window is None or window >= T):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=gqa)
    if gqa:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1).to(scores.dtype)], -1)
    return torch.softmax(scores, dim=-1)[..., :T].to(v.dtype) @ v


def cp_chunks(cp: int, impl: str = "ring", windows=None, seq_len: int = 0) -> list[list[int]]:
    """Which chunks each rank holds: the ring balances the causal work with head-tail chunks (2 x cp), unless
    the layers' sliding `windows` let contiguous chunks (rank r: chunk r of cp) end the ring in fewer steps
    (each rank then needs only its neighbours' K/V: fewer bytes, and the work is balanced by the window);
    Ulysses computes whole sequences on every rank, already balanced: chunk r of cp."""
    if impl != "ring":
        return contiguous_chunks(cp)
    if windows and all(windows):
        head_tail, contiguous = head_tail_chunks(cp), contiguous_chunks(cp)
        steps_of = {
            name: sum(ring_steps(chunks, seq_len // sum(map(len, chunks)), w) for w in windows)
            for name, chunks in (("head_tail", head_tail), ("contiguous", contiguous))
        }
        if steps_of["contiguous"] < steps_of["head_tail"]:
            return contiguous
    return head_tail_chunks(cp)


def apply_context_parallel(model, task, layout: Layout, impl: str = "ring", windows=None):
    """Every attention layer of the model becomes the ring (head-tail chunks) or Ulysses' all-to-alls
    (chunk r of cp) over this rank's CP group; returns the attention function installed. `windows`: the
    layers' sliding windows (attention_shapes), which may choose other chunks (cp_chunks)."""
    chunks_of = cp_chunks(layout.cp, impl, windows, task.tokens_per_sample)
    if impl == "ulysses":
        attention = ulysses_attention(Ulysses(layout.group("cp"), chunks_of))
    else:
        attention = ring_attention(Ring(layout.group("cp"), chunks_of))
    task.set_attention(model, attention)  # CP: the model contract's hook (Task.set_attention)
    return attention


def whole_sequence_predict(model, task, attention, layout: Layout):
    """evaluate()'s `predict`: evaluation reads whole sequences (no gradients, little memory) with causal
    SDPA on every rank (FSDP needs them all in each forward); CP rank 0 returns the outputs, so each
    sample counts once."""

    def predict(*inputs):
        with plain_attention(task, model, attention) if attention else nullcontext():
            outputs = model(*inputs)
        return outputs if layout.cp_rank == 0 else None

    return predict


@contextmanager
def plain_attention(task, model, attention):
    """Whole sequences on every rank (evaluation, the loss check): causal SDPA, then the ring again."""
    task.set_attention(model, None)
    try:
        yield
    finally:
        task.set_attention(model, attention)


def ring_bytes_per_step(
    layout: Layout, batch_size: int, seq_len: int, width: int, layers: int, accum: int, steps=None
) -> dict:
    """The ring's traffic per rank and optimizer step, fp32: per layer (cp-1) K/V blocks in forward;
    in backward (cp-1) K/V blocks again plus cp dK/dV blocks. A K/V block: 2 x b x s/cp x d. `steps`: the
    ring steps of each layer where a sliding window ends the ring early (ring_steps; default cp each): S
    steps send S-1 K/V blocks each way and S dK/dV blocks (none when S is 1)."""
    block = 2 * batch_size * (seq_len // layout.cp) * width * 4
    steps = steps or [layout.cp] * layers
    forward = sum(s - 1 for s in steps) * block * accum
    backward = sum((s - 1) + (s if s > 1 else 0) for s in steps) * block * accum
    return {"forward": forward, "backward": backward}


def cp_loss(task, layout: Layout, device, impl: str = "ring", windows=None):
    """The loss of this rank's tokens of a micro-batch, `with loss(model, micro_batch) as loss_sum:`, a context
    its backward runs in (PyTorch's context_parallel must see both). Chosen once, for cp_forward_backward:
    without CP the whole sequence; under the ring this rank's chunks (r and 2cp-1-r), under Ulysses chunk r of
    cp (cp_chunks: `windows` as apply_context_parallel's), at their real positions."""
    if layout.cp == 1:

        @contextmanager
        def whole_sequence_loss(model, mb):
            yield task.loss_of(model, mb)[0]

        return whole_sequence_loss
    # CP: this rank's tokens, at the same positions of every sequence (its chunks), and their targets
    chunks_of = cp_chunks(layout.cp, impl, windows, task.tokens_per_sample)
    positions = rank_positions(task.tokens_per_sample, chunks_of[layout.cp_rank], sum(map(len, chunks_of)), device)

    @contextmanager
    def ring_loss(model, mb):
        ids, targets = task.inputs(mb)[0][:, positions], task.next_token_targets(mb)[:, positions]  # (batch, tokens)
        if "position_ids" not in mb:
            yield task.loss_at(model, ids, targets, positions)[0]
            return
        # CP: --document_mask: positions in the documents, and the whole sequences' documents for every mask
        documents = documents_of(mb["position_ids"])
        yield task.loss_at(model, ids, targets, mb["position_ids"][:, positions], documents)[0]

    ring_loss.positions = positions  # the cut check compares each module's output at these positions
    return ring_loss


def cp_forward_backward(
    accelerator, model, micro_batches: list, n_global_targets, loss_of, grad_scale: int, unsharded_accumulation=False
) -> torch.Tensor:
    """Forward and backward of this rank's slice of every sequence; returns its loss sum (its own tokens).
    `loss_of` (cp_loss's) gives the loss of this rank's tokens. The loss is divided by the global batch's
    target count; FSDP averages gradients over the dp x cp ranks, so it is scaled back by their number
    (`grad_scale`): the gradient is that of (global loss sum / global targets). FSDP reduce-scatters every
    micro-batch's gradients, as in train_fsdp.py; `unsharded_accumulation`: once, at the last."""
    step_loss_sum = torch.zeros((), device=accelerator.device)
    for i, mb in enumerate(micro_batches):
        if unsharded_accumulation and isinstance(model, FSDPModule):  # FSDP's no_sync until the last
            model.set_requires_gradient_sync(i == len(micro_batches) - 1)
        with accelerator.autocast():  # Accelerate: autocast
            with loss_of(model, mb) as loss_sum:  # CP: the loss of this rank's tokens
                accelerator.backward(loss_sum * grad_scale / n_global_targets)  # Accelerate: backward
        step_loss_sum += loss_sum.detach()
    return step_loss_sum


def ulysses_bytes_per_step(layout: Layout, batch_size: int, seq_len: int, shapes: dict, accum: int) -> dict:
    """Ulysses' all-to-all buffers per rank and optimizer step, fp32 (sharded_costs.ulysses_bytes_per_layer):
    per layer q, k, v in and the output back in forward, the same four in backward, each b x s/cp x width."""
    per_layer = ulysses_bytes_per_layer(batch_size, seq_len, layout.cp, shapes["q_width"], shapes["width"], 4)
    return {k: per_layer[k] * shapes["layers"] * accum for k in ("forward", "backward")}


def cp_start_line(layout: Layout, args, seq_len: int, kv_shape, impl: str = "ring") -> tuple[str, dict | None]:
    """What the run's first lines say of CP, and its traffic per rank and optimizer step (the formula;
    None without CP). `kv_shape`: what the attention receives (attention_shapes)."""
    if layout.cp == 1:
        return "context parallel over 1 rank: nothing to cut, so the ring attention is not installed", None
    if impl == "ulysses":
        formula = ulysses_bytes_per_step(layout, args.batch_size, seq_len, kv_shape, args.gradient_accumulation_steps)
        heads = kv_shape["q_heads"] // layout.cp
        cp_line = (
            f"context parallel (Ulysses): {layout.cp} ranks per group x {layout.dp} data-parallel; each rank holds "
            f"{seq_len // layout.cp} of the {seq_len} tokens (chunk r of {layout.cp}) and attends over all of them "
            f"with {heads} of the {kv_shape['q_heads']} heads; all-to-all buffers per rank and step: "
            f"{formula['forward'] / 2**20:.3f} MiB forward, {formula['backward'] / 2**20:.3f} MiB backward "
            f"({layout.cp - 1}/{layout.cp} of it leaves the rank); FSDP over dp x cp = {layout.dp * layout.cp} ranks"
        )
        return cp_line, formula
    width, layers, accum = kv_shape["width"], kv_shape["layers"], args.gradient_accumulation_steps
    windows = kv_shape.get("windows") or [None] * layers
    chunks_of = cp_chunks(layout.cp, impl, windows, seq_len)  # CP: a window may choose contiguous chunks
    c = seq_len // sum(map(len, chunks_of))
    steps = [ring_steps(chunks_of, c, w) for w in windows]
    ring_formula = ring_bytes_per_step(layout, args.batch_size, seq_len, width, layers, accum, steps)
    full = ring_bytes_per_step(layout, args.batch_size, seq_len, width, layers, accum)
    not_sent = sum(full.values()) - sum(ring_formula.values())
    held = (
        f"chunks r and {2 * layout.cp - 1}-r of {2 * layout.cp}"
        if len(chunks_of[0]) == 2
        else f"chunk r of {layout.cp}: the windows need only the neighbours' K/V"
    )
    windowed = sum(w is not None for w in windows)
    window_part = (
        f"; sliding windows in {windowed} of {layers} layers: the ring stops after {min(steps)} of {layout.cp} "
        f"steps there, {not_sent / 2**20:.3f} MiB per step not sent"
        if not_sent
        else ""
    )
    cp_line = (
        f"context parallel (ring): {layout.cp} ranks per ring x {layout.dp} data-parallel; each rank "
        f"holds {seq_len // layout.cp} of the {seq_len} tokens ({held}); ring traffic per rank and step: "
        f"{ring_formula['forward'] / 2**20:.3f} MiB forward, {ring_formula['backward'] / 2**20:.3f} MiB backward"
        f"{window_part}; FSDP over dp x cp = {layout.dp * layout.cp} ranks"
    )
    return cp_line, ring_formula | ({"not_sent": not_sent} if not_sent else {})


def ring_traffic(sender, ring_formula: dict, steps: int, name: str = "ring") -> dict:
    """The summary's measured traffic of the run (`sender`: the Ring, or Ulysses and its all-to-all buffers,
    name "all_to_all"), per rank and step, beside the formula's; under sliding windows, the ring's bytes not
    sent (per rank and step)."""
    steps = max(steps, 1)
    traffic = {
        f"{name}_mib_per_step_rank": {k: round(v / steps / 2**20, 4) for k, v in sender.sent_bytes.items()},
        f"{name}_formula_mib_per_step_rank": {k: round(ring_formula[k] / 2**20, 4) for k in ("forward", "backward")},
    }
    if "not_sent" in ring_formula:
        traffic[f"{name}_not_sent_by_windows_mib_per_step_rank"] = round(ring_formula["not_sent"] / 2**20, 4)
    return traffic


def reset_traffic(attention) -> None:
    """The cut check's probe step sent bytes too: the run's summary counts its own steps' from zero."""
    for sender in (getattr(attention, "ring", None), getattr(attention, "ulysses", None)):
        if sender is not None:
            sender.sent_bytes = dict.fromkeys(sender.sent_bytes, 0)
            sender.blocks_computed = sender.blocks_skipped = 0


def check_cp_size(cp_size: int, n_processes: int) -> None:
    """--cp_size divides the processes (the rest is data parallel), or is -1 (all of them)."""
    if cp_size != -1 and (cp_size < 1 or n_processes % cp_size):
        divisors = ", ".join(str(d) for d in range(1, n_processes + 1) if n_processes % d == 0)
        raise UsageError(
            f"--cp_size {cp_size} does not divide the {n_processes} processes: use a --cp_size that divides "
            f"{n_processes} ({divisors}), or -1 for all of them"
        )


def check_cp(layout: Layout, model, task, args) -> None:
    """One line each: the model's Task can replace its attention, 2 x cp divides the sequence, no dropout
    in the ring, nothing else that cuts the sequence."""
    if layout.cp > 1:
        task.set_attention(model, None)  # a Task that cannot replace the model's attention says so here
        missing = [m for m in ("next_token_targets", "loss_at") if not callable(getattr(task, m, None))]
        if missing:  # the loss of a rank's tokens: a language model's Task (CausalLMTask) has both
            raise UsageError(
                f"--cp_size: the Task has no {' and no '.join(missing)}, which give the loss of this rank's tokens: "
                "subclass CausalLMTask (common/causal_lm.py), or implement them in the MODEL section (docs/cp.md)"
            )
    seq_len, impl = task.tokens_per_sample, getattr(args, "cp_impl", "ring")
    if layout.cp > 1 and impl == "ulysses" and (not seq_len or seq_len % layout.cp):
        raise UsageError(
            f"--cp_size {layout.cp} --cp_impl ulysses cuts each {seq_len}-token sequence into {layout.cp} chunks, "
            f"which does not divide it: use a --block_size divisible by {layout.cp}"
        )
    if layout.cp > 1 and impl == "ring" and (not seq_len or seq_len % (2 * layout.cp)):
        raise UsageError(
            f"--cp_size {layout.cp} cuts each {seq_len}-token sequence into 2 x cp = {2 * layout.cp} chunks "
            f"(head-tail balancing), which does not divide it: use a --block_size divisible by {2 * layout.cp}"
        )
    if layout.cp > 1 and (getattr(args, "dropout", 0) or 0) > 0:  # a model of one's own has no --dropout
        raise UsageError("--dropout: CP's attention has no dropout: use --dropout 0, or train without --cp_size")
    sequence_parallel, loss_parallel = getattr(args, "sequence_parallel", False), getattr(args, "loss_parallel", False)
    if layout.cp > 1 and (layout.pp > 1 or sequence_parallel or loss_parallel):
        flag = "--pp_size" if layout.pp > 1 else "--sequence_parallel" if sequence_parallel else "--loss_parallel"
        raise UsageError(f"{flag} beside --cp_size is not supported yet (the ring cuts the sequence): drop one of them")


def check_ulysses_heads(layout: Layout, shapes: dict) -> None:
    """Ulysses cuts the heads over the CP ranks: the query heads and the K/V heads (as the attention receives
    them, attention_shapes) must divide by cp, one line otherwise."""
    q_heads, kv_heads = shapes["q_heads"], shapes["kv_heads"]
    if q_heads % layout.cp or kv_heads % layout.cp:
        kv = f" and {kv_heads} K/V heads" if kv_heads != q_heads else ""
        raise UsageError(
            f"--cp_size {layout.cp} --cp_impl ulysses cuts the attention heads over {layout.cp} ranks, but the model "
            f"has {q_heads} query heads{kv}: use a --cp_size that divides the heads, or --cp_impl ring"
        )


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
        help="ranks that cut each sequence between them: all processes (-1); the other factor is data parallel",
    )
    g.add_argument(
        "--cp_impl",
        choices=["ring", "ulysses"],
        default="ring",
        help="ring: K/V travel around the ranks, any head count (sequence divisible by 2 x cp); ulysses: an "
        "all-to-all turns sequence shards into head shards, fused attention on whole sequences, an all-to-all "
        "back: fewer bytes (half the ring's at cp 2), but the heads (and K/V heads) must divide by cp; both honour "
        "each layer's sliding window, sinks and soft-capping (docs/cp.md)",
    )
    args = parser.parse_args()
    args.output_dir = args.output_dir or "runs/cp"
    check_core_args(args)

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
    check_cp_size(args.cp_size, accelerator.num_processes)  # CP: --cp_size divides the processes, or is -1
    dp_shard = 1 if args.cp_size == -1 else -1  # CP: every process in one ring (-1) leaves no data parallel
    layout = Layout.from_degrees(accelerator.num_processes, cp=args.cp_size, dp_shard=dp_shard)  # CP: dp x cp
    dp_size = layout.dp  # CP: the CP ranks of one group read the same samples
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
    # CP: and the attention it calls (Task.set_attention) and a forward at given positions (Task.forward_at)
    from common.model import language_model

    model, task = language_model(args, data)
    model = model.to(accelerator.device)
    units = task.units(model)  # the repeated units: one FSDP unit each, --compile
    n_params, model_line = count_parameters(model), task.describe(model)
    check_cp(layout, model, task, args)  # CP: a model without them is refused, one line
    kv_shape = attention_shapes(task, model, accelerator.device) if layout.cp > 1 else None  # CP: bytes, heads
    if layout.cp > 1 and args.cp_impl == "ulysses":
        check_ulysses_heads(layout, kv_shape)  # CP: Ulysses cuts the heads: they divide by cp, or one line
    resume_path, facts = check_resume_and_output(accelerator, args, model, task, global_batch_size, layout)
    reference = uncut_copy(model, task, args.skip_cut_check)  # the model as built: what the cut must compute
    layout.build_mesh(accelerator.device.type)

    # ---------------------------------------- CP: the strategy
    attention = None
    if layout.cp > 1:  # CP: every attention layer becomes the ring over the CP group
        attention = apply_context_parallel(model, task, layout, args.cp_impl, kv_shape["windows"])
    if args.compile:
        compile_units(units, accelerator)
    if layout.world_size > 1:  # FSDP over dp_shard x cp: gradients reduce over both (CP ranks hold the same weights)
        apply_fsdp(units, [model], layout.fsdp_mesh, accelerator.mixed_precision)
    windows = kv_shape["windows"] if kv_shape else None  # CP: the layers' sliding windows choose the chunks
    loss_of = cp_loss(task, layout, accelerator.device, args.cp_impl, windows)  # the loss of this rank's tokens
    grad_scale = layout.dp * layout.cp  # FSDP averages the gradients over dp x cp ranks: the step scales back

    # ---------------------------------------- optimizer (after sharding: it sees the shards)
    optimizer = make_optimizer(model, args)
    scheduler = make_scheduler(optimizer, args)
    # Accelerate: optimizer/scheduler wrappers (not the model: FSDP owns it); the loader sharded over the dp ranks
    optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
    train_sampler = train_loader.sampler
    train_loader = shard_loader(train_loader, accelerator, layout)
    whole = plain_attention(task, model, attention) if attention else None  # CP: whole sequences, causal SDPA
    check_task_contract(task, model, data.validation, accelerator.device, whole)  # CP: on whole sequences
    probe_step = partial(cp_forward_backward, accelerator, model, loss_of=loss_of, grad_scale=grad_scale)  # CP: a step
    probe_step.token_positions = getattr(loss_of, "positions", None)  # CP: the cut check compares outputs there
    cut_line = check_cut(accelerator, model, probe_step, reference, task, data.validation, grad_accum, layout)
    reset_traffic(attention)  # CP: the summary's bytes are the run's, not the probe's
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
    predict = whole_sequence_predict(model, task, attention, layout)  # CP: evaluation reads whole sequences
    monitor = RunMonitor(accelerator, args, "train_cp", feed, layout.world_size, global_batch_size)
    cp_line, ring_formula = cp_start_line(layout, args, task.tokens_per_sample, kv_shape, args.cp_impl)  # CP: bytes
    costs = sharded_start_line(model, layout, n_params, args.optimizer, accelerator)
    monitor.start(task, model_line, n_params, data, [cp_line, costs, cut_line], resume_path, layout)

    # ---------------------------------------- the training loop
    step, last_step = progress["step"], min(args.max_steps, args.stop_at_step or args.max_steps)
    model.train()
    while step < last_step and not feed.preempted:
        with monitor.timed_step():  # training time: the records, evaluations and checkpoints below are not
            micro_batches, n_global_targets = feed.next_step()
            with monitor.collectives():  # CP: K/V around the ring every layer; FSDP: all-gather, reduce-scatter
                loss_sum = cp_forward_backward(accelerator, model, micro_batches, n_global_targets, loss_of, grad_scale)
            grad_norm = clip_grad_norm_(model.parameters(), args.max_grad_norm)  # the whole model's norm, every rank
            lr = scheduler.get_last_lr()[0]
            optimizer.step()  # FSDP: each rank updates its own shard
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

        if monitor.due(step, "train"):  # CP: every rank holds the loss of its own tokens: the sum is the batch's
            loss = (accelerator.reduce(loss_sum, reduction="sum") / n_global_targets).item()  # Accelerate: all-reduce
            monitor.train(step, loss, lr, grad_norm)
        if monitor.due(step, "eval"):
            monitor.eval(
                step, evaluate(accelerator, model, task, data.validation, args.eval_batch_size, layout, predict)
            )
        if monitor.due(step, "checkpoint") or feed.preempted:  # every rank writes its part (a collective)
            save_checkpoint(accelerator, args, step, feed, model, optimizer, scheduler, facts)
    feed.close()

    # ---------------------------------------- save
    if step == args.max_steps:  # every rank (it gathers what the model holds); the main process writes
        export_model(accelerator, model, task, data_source(args), Path(args.output_dir) / "model", layout)
    costs = sharded_summary(accelerator, layout, n_params, args.optimizer, model, optimizer)
    if attention:  # CP: measured traffic of the run (the ring's, or the all-to-all buffers) vs the formula
        sender, name = (attention.ulysses, "all_to_all") if args.cp_impl == "ulysses" else (attention.ring, "ring")
        costs |= {"cp_impl": args.cp_impl} | ring_traffic(sender, ring_formula, step - progress["step"], name)
    monitor.summary(step, preempted=feed.preempted, **costs)
    accelerator.wait_for_everyone()
    accelerator.end_training()  # Accelerate: closes trackers and destroys the process group


if __name__ == "__main__":
    run_main(main)
