"""Context parallelism's tokens and masks (train_cp.py, train_hybrid.py --cp_size): the positions of
a rank's tokens in the sequence and their loss (cp_loss), the blocks of a ring step that the causal
mask, a sliding window and the document mask (--document_mask) leave something in, each with the
mask it carries, and the model's own attention back for whole sequences (evaluation, the contract's
check). The ring's loop and its merge stay in the lesson; its transfers are in cp_comms.py."""

from contextlib import contextmanager, nullcontext

import torch

from .causal_lm import documents_of
from .cp_costs import block_in_window, cp_chunks


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


# ---------------------------------------- whole sequences: the model's own attention again
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
