"""The ring attention of scripts/train_cp.py alone, against causal SDPA on random q/k/v (tests/test_cp.py).

Run under torchrun (gloo) on 4 processes: sub-groups of the first 2, 3 and 4 ranks each form a ring;
per ring, with head-tail chunks and with contiguous ones, every rank checks its slice of the forward
output and of the gradients of q, k and v against SDPA over the whole sequence, and counts the
attention blocks it computed. Rank 0 prints one JSON line: per ring size, the worst error over the
ranks and the blocks each rank computed."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from train_cp import Ring, RingAttention, contiguous_chunks, head_tail_chunks, rank_positions


def check(group, cp: int, chunks_of: list[list[int]]) -> tuple[float, int]:
    """The worst |ring - SDPA| of this rank (output, dq, dk, dv), and the blocks it computed."""
    torch.manual_seed(cp)  # the same q, k, v, dout on every rank
    B, H, T, D = 2, 3, 8 * 2 * 3 * 4, 16  # T divides 2 x cp for cp = 2, 3, 4
    q, k, v, dout = (torch.randn(B, H, T, D) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*full, is_causal=True)
    out.backward(dout)

    ring = Ring(group, chunks_of)
    n_chunks = sum(len(c) for c in chunks_of)
    pos = rank_positions(T, chunks_of[ring.rank], n_chunks)
    mine = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
    out_mine = RingAttention.apply(*mine, ring)
    blocks = ring.blocks_computed
    out_mine.backward(dout[:, :, pos])
    errors = [(out_mine - out[:, :, pos]).detach().abs().max()]
    errors += [(m.grad - f.grad[:, :, pos]).abs().max() for m, f in zip(mine, full, strict=True)]
    return float(torch.stack(errors).max()), blocks


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {}
    for cp in (2, 3, 4):
        group = dist.new_group(list(range(cp)))  # every rank takes part in creating every group
        if rank >= cp:
            continue
        for name, chunks_of in (("head_tail", head_tail_chunks(cp)), ("contiguous", contiguous_chunks(cp))):
            error, blocks = check(group, cp, chunks_of)
            gathered = [None] * cp
            dist.all_gather_object(gathered, (error, blocks), group=group)
            results[f"{cp}_{name}"] = {
                "max_error": max(e for e, _ in gathered),
                "blocks_per_rank": [b for _, b in gathered],
            }
    dist.barrier()
    if rank == 0:
        print("RESULT " + json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
