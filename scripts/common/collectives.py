"""Counting the collectives a step really runs (the first lines of the sharded scripts and Local SGD,
the summary's `collectives_first_step_rank0`): every kind, forward and backward, and their buffers."""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives run while it is active, forward and backward, and the size of the
    full buffer each works on (the unsharded tensor of an all-gather or reduce-scatter): the
    DTensor collectives of TP (functional ops) and the c10d ops of FSDP, pipeline send/recv and
    plain torch.distributed calls. `enabled=False` makes it a no-op (the steps after the first)."""

    NAMES = {
        "all_reduce": "all_reduce",
        "allreduce_": "all_reduce",
        "all_gather_into_tensor": "all_gather",
        "_allgather_base_": "all_gather",
        "allgather_": "all_gather",
        "allgather_into_tensor_coalesced_": "all_gather",
        "reduce_scatter_tensor": "reduce_scatter",
        "_reduce_scatter_base_": "reduce_scatter",
        "reduce_scatter_": "reduce_scatter",
        "reduce_scatter_tensor_coalesced_": "reduce_scatter",
        "all_to_all_single": "all_to_all",
        "broadcast_": "broadcast",
        "send": "send",
        "recv_": "recv",
    }

    def __init__(self, enabled: bool = True):
        super().__init__()
        self.enabled = enabled
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)

    def __enter__(self):
        return super().__enter__() if self.enabled else self

    def __exit__(self, *exc):
        return super().__exit__(*exc) if self.enabled else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if func.namespace in ("_c10d_functional", "c10d") and name in self.NAMES:
            kind = self.NAMES[name]
            tensors = [
                t for a in args for t in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(t, torch.Tensor)
            ]
            buffer = max((t.nbytes for t in tensors), default=0)  # the full (unsharded) buffer of the collective
            if func.namespace == "_c10d_functional" and kind == "all_gather":
                buffer *= args[1]  # functional all-gather gets the shard and the group size
            self.calls[kind] += 1
            self.bytes[kind] += buffer
        return func(*args, **(kwargs or {}))

    def report(self) -> dict:
        return {
            kind: {"calls": self.calls[kind], "mib": round(self.bytes[kind] / 2**20, 4)} for kind in sorted(self.calls)
        }


@contextmanager
def count_first_step(monitor):
    """RunMonitor.collectives: counts the collectives of the run's first step (forward and backward, every
    kind) for the summary; later steps run without the counter, and so does --compile (a dispatch mode
    stops it)."""
    first = monitor.step == monitor.start_step and not monitor.args.compile
    if monitor.first_step_collectives is None:
        monitor.first_step_collectives = {}  # stays empty under --compile
    with CollectiveCounter(enabled=first) as counter:
        yield
    if first:
        monitor.first_step_collectives = counter.report()
        collectives = ", ".join(f"{k} {v['calls']} calls / {v['mib']:.3f} MiB" for k, v in counter.report().items())
        monitor.write(f"  collectives of the first step (rank 0): {collectives or 'none'}")
