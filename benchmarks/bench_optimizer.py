#!/usr/bin/env python
"""One AdamW step, three kernels (one parameter at a time, `foreach`, `fused`), on plain tensors
and on DTensors (a one-process gloo mesh, the FSDP placement Shard(0)): what make_optimizer's
choice of kernel is worth per step. The tensors have the shapes of the `tiny` model's 37
parameters. One process, one thread, a few seconds. Prints a table, writes
benchmarks/results/optimizer.json.

    python benchmarks/bench_optimizer.py [--steps 300]
"""

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from harness import REPO, one_process_mesh
from torch.distributed.tensor import Shard, distribute_tensor

RESULTS = REPO / "benchmarks" / "results"
KERNELS = {"one at a time": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def tiny_model_shapes() -> list[tuple]:
    """The parameter shapes of the `tiny` preset (built on the meta device: no memory, no data)."""
    import sys

    sys.path.insert(0, str(REPO / "scripts"))
    from common.model import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig.from_preset("tiny"))
    return [tuple(p.shape) for p in model.parameters()]


def ms_per_step(params: list, kernel: dict, steps: int) -> float:
    optimizer = torch.optim.AdamW(params, lr=1e-3, **kernel)
    for _ in range(10):  # state created, caches warm
        optimizer.step()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(steps // 5):
            optimizer.step()
        times.append((time.perf_counter() - start) / (steps // 5) * 1e3)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per measurement")
    args = p.parse_args()
    mesh = one_process_mesh()
    shapes = tiny_model_shapes()
    rows = []
    for kind in ("plain", "DTensor"):
        for name, kernel in KERNELS.items():
            params = []
            for shape in shapes:
                t = torch.randn(shape)
                p_ = torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)]) if kind == "DTensor" else t)
                p_.grad = torch.randn_like(p_)
                params.append(p_)
            rows.append(
                {"tensors": kind, "kernel": name, "ms_per_step": round(ms_per_step(params, kernel, args.steps), 3)}
            )
            print(f"{kind:8} {name:14} {rows[-1]['ms_per_step']:.3f} ms", flush=True)
    dist.destroy_process_group()
    print(f"\nAdamW, {len(shapes)} parameters of the tiny model's shapes, one CPU thread")
    print("| tensors | one at a time | foreach | fused |\n|---|---|---|---|")
    for kind in ("plain", "DTensor"):
        ms = [r["ms_per_step"] for r in rows if r["tensors"] == kind]
        print(f"| {kind} | " + " | ".join(f"{m:.2f} ms" for m in ms) + " |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "optimizer.json"
    path.write_text(json.dumps({"torch": torch.__version__, "n_params": len(shapes), "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
