"""Context parallelism's algorithm beside its lesson (train_cp.py; train_hybrid.py --cp_size and
plan_layout.py read it too), as picotron keeps context_parallel.py: the lesson holds the ring's loop,
its log-sum-exp merge and Ulysses' attention; this module what they call, in the order a reader meets it:

    the chunk rule      which chunks of a sequence each rank holds (head-tail balancing, or contiguous
                        chunks under sliding windows) and how many ring steps a window leaves needed
    the blocks          which (query chunk x K/V chunk) blocks a rank computes at a ring step, under the
                        causal mask, a sliding window and the document mask, each with its mask
    the block kernels   attention of one block, forward and backward, with the log-sum-exp the ring
                        merges by; causal attention over whole sequences (Ulysses)
    the sinks           a learned logit per head (gpt-oss) merged into the ring's rows, and its gradient
    the rank's loss     the positions of a rank's tokens in the sequence and their loss (cp_loss)
    whole sequences     the model's own attention again (evaluation, the contract's check)

The transfers (Ring, Ulysses) are in cp_comms.py; the bytes and the run's lines about CP in cp_costs.py.
"""

from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F

from .causal_lm import documents_of


# ======================================== the chunk rule: which chunks each rank holds
def head_tail_chunks(cp: int) -> list[list[int]]:
    """Which chunks of a sequence cut into 2 x cp each rank holds: rank r holds r and 2cp-1-r."""
    return [[r, 2 * cp - 1 - r] for r in range(cp)]


def contiguous_chunks(cp: int) -> list[list[int]]:
    """Without balancing: rank r holds chunk r of cp (picotron's split). Under a causal mask rank r
    then computes r + 1 blocks, rank cp - 1 all cp of them."""
    return [[r] for r in range(cp)]


def block_in_window(q_chunk: int, kv_chunk: int, c: int, window: int | None) -> bool:
    """A causal mask within `window` tokens (None: the whole past) leaves something of the block q
    chunk x kv chunk (c tokens each): the kv chunk is not after the q chunk, nor wholly outside the
    window."""
    d = (q_chunk - kv_chunk) * c  # the offset of the block's row 0 from its col 0
    return d >= 0 and (window is None or d - (c - 1) < window)


def ring_steps(chunks_of: list[list[int]], c: int, window: int | None) -> int:
    """How many steps of the ring some rank computes something in: the ring stops after them (the
    K/V a window leaves unneeded are not sent). Every step without a window."""
    size = len(chunks_of)
    needed = [
        s
        for s in range(size)
        for r in range(size)
        if any(block_in_window(qc, kc, c, window) for qc in chunks_of[r] for kc in chunks_of[r - s])
    ]
    return max(needed) + 1


def cp_chunks(cp: int, impl: str = "ring", windows=None, seq_len: int = 0) -> list[list[int]]:
    """Which chunks each rank holds: the ring balances the causal work with head-tail chunks (2 x
    cp), unless the layers' sliding `windows` let contiguous chunks (rank r: chunk r of cp) end the
    ring in fewer steps (each rank then needs only its neighbours' K/V: fewer bytes, and the work is
    balanced by the window); Ulysses computes whole sequences on every rank, already balanced: chunk
    r of cp."""
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


# ======================================== the blocks a rank computes
def causal_blocks(q_chunks: list[int], kv_chunks: list[int]) -> list[tuple[int, int, bool]]:
    """The (q chunk, kv chunk) pairs a causal mask leaves something to compute: a kv chunk after the
    q chunk is skipped, the same chunk is a causal (diagonal) block, an earlier one a full block.
    Returns (index of the q chunk in q_chunks, index of the kv chunk in kv_chunks, is_diagonal)."""
    return [(i, j, qc == kc) for i, qc in enumerate(q_chunks) for j, kc in enumerate(kv_chunks) if kc <= qc]


def blocks_per_rank(chunks_of: list[list[int]]) -> list[int]:
    """The attention blocks (q chunk x kv chunk, a diagonal one counted whole) each rank computes
    over a whole ring: what head-tail balancing evens out."""
    return [sum(len(causal_blocks(mine, theirs)) for theirs in chunks_of) for mine in chunks_of]


def masked_blocks(q_chunks: list[int], kv_chunks: list[int], c: int, window: int | None) -> list:
    """The blocks of `q_chunks` x `kv_chunks` (chunks of c tokens) a causal mask within `window`
    tokens (None: the whole past) leaves something in: (index of the q chunk, of the kv chunk, rows,
    cols, causal, keep): `rows`/`cols` slice the block, `causal` is a whole diagonal block, `keep` a
    bool mask of (rows, cols) or None."""
    blocks = []
    for i, qc in enumerate(q_chunks):
        for j, kc in enumerate(kv_chunks):
            if not block_in_window(qc, kc, c, window):
                continue  # after the query chunk, or wholly outside the window
            d = (qc - kc) * c  # row 0's offset from col 0: row a sees col b at offset d + a - b
            if window is None or d + c - 1 < window:
                blocks.append((i, j, slice(0, c), slice(0, c), d == 0, None))
                continue
            rows = torch.arange(min(c, window + c - 1 - d))[:, None]  # the rows that see some key
            cols = torch.arange(max(0, d - window + 1), c)  # the keys some row sees
            offset = d + rows - cols[None]
            keep = (offset >= 0) & (offset < window)
            blocks.append((i, j, slice(0, rows.shape[0]), slice(int(cols[0]), c), False, keep))
    return blocks


def document_blocks(blocks: list, q_chunks: list[int], kv_chunks: list[int], c: int, documents):
    """masked_blocks' blocks with the document mask (--document_mask) on top: a query sees only keys
    of its own document. `documents`: (batch, tokens) ids of the whole sequences. A block no
    sequence keeps anything of is dropped (not computed); one kept whole stays unmasked; the others
    carry a (batch, 1, rows, cols) mask."""
    if documents is None:
        return blocks
    kept = []
    for i, j, rows, cols, causal, keep in blocks:
        q0, k0 = q_chunks[i] * c, kv_chunks[j] * c  # the chunks' first positions in the sequence
        q_docs = documents[:, q0 + rows.start : q0 + rows.stop, None]
        same = (q_docs == documents[:, None, k0 + cols.start : k0 + cols.stop])[:, None]
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


def step_blocks(chunks_of: list[list[int]], rank: int, step: int, c: int, window=None, documents=None):
    """The blocks `rank` computes at step `step` of the ring, against the K/V of rank - step: those
    the masks leave something in (masked_blocks, document_blocks), as (rows, cols, causal, keep):
    `rows` slice this rank's tokens, `cols` the visiting K/V's, `keep` a mask or None."""
    mine, theirs = chunks_of[rank], chunks_of[(rank - step) % len(chunks_of)]
    blocks = document_blocks(masked_blocks(mine, theirs, c, window), mine, theirs, c, documents)
    sliced = []
    for i, j, rows, cols, causal, keep in blocks:
        rows = slice(i * c + rows.start, i * c + rows.stop)  # among this rank's tokens
        cols = slice(j * c + cols.start, (j + 1) * c)  # among the visiting K/V's
        sliced.append((rows, cols, causal, keep))
    return sliced


# ======================================== the block kernels
# The kernel PyTorch's own ring attention calls, chosen by device: on CPUs the flash kernel for CPUs
# (a cropped window block's mask given as an additive float mask); on CUDA flash (fp16/bf16) or
# memory-efficient (fp32). Plain matmuls (a materialised score matrix) remain where no kernel takes
# the scores: soft-capped ones (Gemma 2), and a cropped window block on CUDA.
def _cuda_flash(q) -> bool:
    return q.dtype in (torch.float16, torch.bfloat16)


def _plain(q, keep, softcap) -> bool:
    return softcap is not None or (q.is_cuda and keep is not None)


def _scores(q, k, scale: float, causal: bool, keep, softcap):
    """The block's scores in fp32 as the model computes them (soft-capped, masked), and the uncapped
    tanh."""
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


def _additive_mask(keep, dtype):
    """The CPU flash kernel takes a mask as a float to add: 0 kept, -inf dropped."""
    return None if keep is None else torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, float("-inf"))


def block_attention(q, k, v, causal: bool, scale: float, keep=None, softcap=None):
    """Attention of the query rows `q` over one K/V block: its output and the log-sum-exp of every
    row, (batch, heads, rows) fp32 contiguous. `causal`: a diagonal block (a chunk over its own
    keys); `keep`: the bool mask of a cropped window block ((rows, cols), or (batch, 1, rows, cols)
    with documents); `softcap`: scores soft-capped as softcap * tanh(s / softcap)."""
    aten = torch.ops.aten
    if _plain(q, keep, softcap):
        scores, _ = _scores(q, k, scale, causal, keep, softcap)
        lse = scores.logsumexp(-1)  # -inf on a row that sees no key here (another document): weights 0
        out = torch.exp(scores - lse[..., None]).nan_to_num(0.0) @ v.float()
        return out.to(q.dtype), lse.contiguous()
    if not q.is_cuda:
        flash_for_cpu = aten._scaled_dot_product_flash_attention_for_cpu
        out, lse = flash_for_cpu(q, k, v, 0.0, causal, attn_mask=_additive_mask(keep, q.dtype), scale=scale)
        if keep is not None and keep.dim() == 4:  # a row of another document than every key: lse 0 here
            lse = lse.masked_fill(~keep.any(-1), float("-inf"))
    elif _cuda_flash(q):
        out, lse, *_ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=scale)
    else:
        out, lse, *_ = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
        lse = lse[..., : q.shape[2]]  # its rows come padded to a multiple of 32
    return out, lse.float().contiguous()  # the CPU kernel's is laid out (batch, rows, heads)


def block_attention_backward(dout, q, k, v, out, lse, causal: bool, scale: float, keep=None, softcap=None):
    """dq, dk, dv of one block, given the MERGED output and log-sum-exp of its rows (over every
    block they attend to, and the sink): the kernel's exp(S - lse) is then this block's share of the
    whole row's softmax, and its rowsum(dO * O) the whole row's, so the block's gradients are exact
    parts of the whole."""
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
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=_additive_mask(keep, q.dtype), scale=scale
        )
    no_rng = torch.empty((), dtype=torch.long)  # dropout's seed and offset: what the kernels return without it
    if _cuda_flash(q):
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, no_rng, no_rng, scale=scale
        )
    lse = F.pad(lse, (0, -lse.shape[-1] % 32))  # the efficient kernel's layout: rows padded to a multiple of 32
    grads = aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, lse, no_rng, no_rng, 0.0, [True, True, True, False], causal, scale=scale
    )
    return grads[:3]


def whole_sequence_attention(q, k, v, window=None, sinks=None, softcap=None, documents=None):
    """Causal attention over whole sequences (Ulysses, after its all-to-all), within `window` tokens
    and each token's document (`documents`, (batch, tokens) ids): fused SDPA (the mask as a bool
    mask); with sinks or soft-capping, the scores written out (the sink one more column, dropped
    after the softmax)."""
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
        sink = sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1).to(scores.dtype)
        scores = torch.cat([scores, sink], -1)
    return torch.softmax(scores, dim=-1)[..., :T].to(v.dtype) @ v


# ======================================== the sinks
def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple:
    """The ring's merged rows with a learned sink per head (gpt-oss): one more logit of each row,
    value 0, so every weight shrinks; returns (out, lse) with the sink merged in."""
    new_lse = torch.logaddexp(lse, sinks.float().view(1, -1, 1))
    return out * torch.exp(lse - new_lse)[..., None], new_lse


def sinks_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor):
    """d loss / d sink: d out / d sink = -p_sink * out for each row, summed over the rows."""
    row_dot = (dout.float() * out.float()).sum(-1)
    p_sink = torch.exp(sinks.float().view(1, -1, 1) - lse)
    return -(p_sink * row_dot).sum((0, 2)).to(sinks.dtype)


# ======================================== the rank's tokens and their loss
def rank_positions(seq_len: int, chunks: list[int], n_chunks: int, device=None) -> torch.Tensor:
    """The real positions, in the sequence, of a rank's tokens: its chunks, in order."""
    size = seq_len // n_chunks
    return torch.cat([torch.arange(c * size, (c + 1) * size, device=device) for c in chunks])


def loss_positions(mb: dict, positions: torch.Tensor) -> tuple:
    """Task.loss_at's last arguments for this rank's tokens: their `positions` in the sequence;
    under --document_mask (`position_ids` in the micro-batch) their positions in each document,
    and the documents of the whole sequences."""
    if "position_ids" not in mb:
        return (positions,)
    return mb["position_ids"][:, positions], documents_of(mb["position_ids"])


def cp_loss(task, layout, device, impl: str = "ring", windows=None):
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


# ======================================== whole sequences: the model's own attention again
def whole_sequence_predict(model, task, attention, layout):
    """evaluate()'s `predict`: evaluation reads whole sequences (no gradients, little memory) with
    causal SDPA on every rank (FSDP needs them all in each forward); CP rank 0 returns the outputs,
    so each sample counts once."""

    def predict(*inputs):
        with plain_attention(task, model, attention) if attention else nullcontext():
            outputs = model(*inputs)
        return outputs if layout.cp_rank == 0 else None

    return predict


@contextmanager
def plain_attention(task, model, attention):
    """Whole sequences on every rank (evaluation, the loss check): causal SDPA, then `attention`
    (the ring's, or Ulysses') again."""
    task.set_attention(model, None)
    try:
        yield
    finally:
        task.set_attention(model, attention)
