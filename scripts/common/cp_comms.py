"""Context parallelism's communications (train_cp.py, train_hybrid.py --cp_size), apart from the
attention that uses them, as picotron keeps its ring in cp_communications.py: the ring's paired
send and receive of a K/V block (and of its dK/dV on the way home), and Ulysses' all-to-alls that turn
sequence shards into head shards and back. Each counts the bytes it sent (the run's summary). The
algorithm that calls them is in train_cp.py and context_parallel.py; this module imports neither."""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


class Ring:
    """The ring of one CP group: who sends to whom, which chunks each rank holds, what was sent.
    `overlap=False` waits for each transfer before computing (to measure what the overlap hides)."""

    def __init__(self, group, chunks_of: list[list[int]], overlap: bool = True):
        self.group, self.chunks_of, self.overlap = group, chunks_of, overlap
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.sent_bytes = {"forward": 0, "backward": 0}
        self.blocks_computed = self.blocks_skipped = 0

    def count_blocks(self, computed: int, causal: int) -> None:
        """One forward's attention blocks: those computed, and the others of the `causal` blocks a
        causal ring without other masks has this rank compute (skipped by the masks)."""
        self.blocks_computed += computed
        self.blocks_skipped += causal - computed

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
