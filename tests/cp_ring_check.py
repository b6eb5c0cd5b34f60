"""The ring attention of scripts/train_cp.py alone, against attention over the whole sequence on random q/k/v
(tests/test_cp.py).

Run under torchrun (gloo) on 4 processes: sub-groups of the first 2, 3 and 4 ranks each form a ring;
per ring, with head-tail chunks and with contiguous ones, every rank checks its slice of the forward
output and of the gradients of q, k and v against causal SDPA over the whole sequence, and counts the
attention blocks it computed. Then the masks, on rings of 2 and 4, both chunkings: sliding windows smaller
than, equal to and larger than a chunk, sinks (their gradient summed over the ring), soft-capped scores,
packed documents that cross chunk borders (alone, in a window, with sinks and soft-capping), against the
scores written out; the bytes sent against ring_bytes_per_step with the steps the window leaves.
Rank 0 prints one JSON line: per case, the worst error over the ranks, the blocks each rank computed and
skipped, and the bytes sent and predicted."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from train_cp import RingAttention

from common.context_parallel import contiguous_chunks, head_tail_chunks, rank_positions, ring_steps
from common.cp_comms import Ring

B, H, T, D = 2, 3, 8 * 2 * 3 * 4, 16  # T divides 2 x cp for cp = 2, 3, 4: chunks of 24 (head-tail, cp 4) to 96
MASKS = {  # name: (window, sinks, softcap, documents)
    "window5": (5, False, None, False),  # smaller than every chunk
    "window24": (24, False, None, False),  # equal to the head-tail chunk at cp 4
    "window60": (60, False, None, False),  # larger than a chunk at cp 4 (24 and 48 tokens) and head-tail cp 2's (48)
    "sinks": (None, True, None, False),
    "window24_sinks": (24, True, None, False),
    "softcap": (None, False, 2.0, False),
    "window5_softcap": (5, False, 2.0, False),
    "documents": (None, False, None, True),  # packed documents (DOCUMENT_LENGTHS), across chunk borders
    "window24_documents": (24, False, None, True),
    "documents_sinks_softcap": (None, True, 2.0, True),
    "short_documents": (None, False, None, "short"),  # no document crosses a chunk border: every other block empty
}
# sequence 0: documents of 1 to 70 tokens, most crossing a chunk border (chunks of 24 to 96); sequence 1: one
# document, so that blocks kept whole in one sequence carry a mask for the other, and rows that see no key
DOCUMENT_LENGTHS = {True: [[1, 30, 50, 7, 1, 70, 33], [T]], "short": [[12] * (T // 12), [4, 8] * (T // 12)]}


def documents(kind) -> torch.Tensor:
    lengths = DOCUMENT_LENGTHS[kind]
    return torch.stack([torch.repeat_interleave(torch.arange(len(n)), torch.tensor(n)) for n in lengths])


def reference(q, k, v, window=None, sinks=None, softcap=None, docs=None):
    """Attention as the 🤗 eager code computes it: scores, soft-capped, masked to p - window < j <= p, a sink
    column per head, softmax, the sink dropped."""
    scores = q @ k.transpose(-1, -2) * D**-0.5
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    offset = torch.arange(T)[:, None] - torch.arange(T)
    keep = (offset >= 0) & (offset < (window or T))
    if docs is not None:
        keep = keep & (docs[:, None, :, None] == docs[:, None, None, :])
    scores = scores.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(B, H, T, 1)], -1)
    return torch.softmax(scores, -1)[..., :T] @ v


def check(group, cp: int, chunks_of: list[list[int]], mask=(None, False, None, False)) -> dict:
    """The worst |ring - whole sequence| of this rank (output, dq, dk, dv, dsinks), the blocks it computed and
    skipped, the bytes it sent and the formula's."""
    window, with_sinks, softcap, with_documents = mask
    docs = documents(with_documents) if with_documents else None
    torch.manual_seed(cp)  # the same q, k, v, dout, sinks on every rank
    q, k, v, dout = (torch.randn(B, H, T, D) for _ in range(4))
    sinks = torch.randn(H) if with_sinks else None
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    full_sinks = sinks.clone().requires_grad_() if with_sinks else None
    if mask == (None, False, None, False):
        out = F.scaled_dot_product_attention(*full, is_causal=True)
    else:
        out = reference(*full, window, full_sinks, softcap, docs)
    out.backward(dout)

    ring = Ring(group, chunks_of)
    n_chunks = sum(len(c) for c in chunks_of)
    pos = rank_positions(T, chunks_of[ring.rank], n_chunks)
    mine = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
    my_sinks = sinks.clone().requires_grad_() if with_sinks else None
    out_mine = RingAttention.apply(*mine, ring, window, my_sinks, softcap, docs)
    blocks, skipped = ring.blocks_computed, ring.blocks_skipped
    out_mine.backward(dout[:, :, pos])
    errors = [(out_mine - out[:, :, pos]).detach().abs().max()]
    errors += [(m.grad - f.grad[:, :, pos]).abs().max() for m, f in zip(mine, full, strict=True)]
    if with_sinks:  # each rank's share of the sinks' gradient: its rows; the whole one is their sum
        dist.all_reduce(my_sinks.grad, group=group)
        errors.append((my_sinks.grad - full_sinks.grad).abs().max())
    steps = ring_steps(chunks_of, T // n_chunks, window)
    block = 2 * B * H * (T // cp) * D * 4  # one rank's K and V, fp32
    formula = {"forward": (steps - 1) * block, "backward": ((steps - 1) + (steps if steps > 1 else 0)) * block}
    return {"error": float(torch.stack(errors).max()), "blocks": blocks, "skipped": skipped}, ring.sent_bytes, formula


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {}
    for cp in (2, 3, 4):
        group = dist.new_group(list(range(cp)))  # every rank takes part in creating every group
        if rank >= cp:
            continue
        for name, chunks_of in (("head_tail", head_tail_chunks(cp)), ("contiguous", contiguous_chunks(cp))):
            cases = {f"{cp}_{name}": (None, False, None, False)}
            if cp != 3:
                cases |= {f"{cp}_{name}_{m}": mask for m, mask in MASKS.items()}
            for case, mask in cases.items():
                mine, sent, formula = check(group, cp, chunks_of, mask)
                gathered = [None] * cp
                dist.all_gather_object(gathered, (mine, sent), group=group)
                results[case] = {
                    "max_error": max(m["error"] for m, _ in gathered),
                    "blocks_per_rank": [m["blocks"] for m, _ in gathered],
                    "skipped_per_rank": [m["skipped"] for m, _ in gathered],
                    "sent_per_rank": [s for _, s in gathered],
                    "formula": formula,
                }
    dist.barrier()
    if rank == 0:
        print("RESULT " + json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
