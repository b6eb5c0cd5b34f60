#!/usr/bin/env python
"""Where a step's host time goes: forward, backward, gradient clipping, optimizer step and
zero_grad, timed one by one for the `tiny` model at batch 1 on one CPU process: plain (what
train_ddp.py runs on one process), FSDP2 (`apply_fsdp` from train_fsdp.py) and TP
(`apply_tensor_parallel` from train_tp.py) on a one-process mesh. The same optimizer
(make_optimizer) and clipping (clip_grad_norm_) as the scripts. About 20 seconds. Prints a
table, writes benchmarks/results/phases.json.

    python benchmarks/bench_phases.py [--steps 400]

It explains bench_overhead.py's ratios: what a sharded script adds per step, and in which phase.
"""

import argparse
import json
import sys
import time
import types

import torch
import torch.distributed as dist
from harness import REPO, one_process_mesh

sys.path.insert(0, str(REPO / "scripts"))
from common.model import GPT, GPTConfig
from common.sharded import clip_grad_norm_
from common.training import make_optimizer
from train_fsdp import apply_fsdp
from train_tp import apply_tensor_parallel, tensor_parallel_plan

RESULTS = REPO / "benchmarks" / "results"
PHASES = ("forward", "backward", "clip", "optimizer", "zero_grad")


def phase_ms(kind: str, mesh, steps: int) -> dict:
    """Mean ms per phase over the last three quarters of `steps` steps."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny"))
    if kind == "FSDP":
        apply_fsdp(model.blocks, [model], mesh)
    elif kind == "TP":
        apply_tensor_parallel(model, mesh, tensor_parallel_plan(model, False, False))
    optimizer = make_optimizer(model, types.SimpleNamespace(weight_decay=0.1, optimizer="adamw", learning_rate=1e-3))
    tokens = torch.randint(0, 20, (1, 13))
    totals, counted = dict.fromkeys(PHASES, 0.0), 0
    for step in range(steps):
        t = [time.perf_counter()]
        loss = model(tokens).float().square().mean()
        t.append(time.perf_counter())
        loss.backward()
        t.append(time.perf_counter())
        clip_grad_norm_(model.parameters(), 1.0)
        t.append(time.perf_counter())
        optimizer.step()
        t.append(time.perf_counter())
        optimizer.zero_grad(set_to_none=True)
        t.append(time.perf_counter())
        if step >= steps // 4:
            counted += 1
            for i, phase in enumerate(PHASES):
                totals[phase] += t[i + 1] - t[i]
    return {phase: round(seconds / counted * 1e3, 3) for phase, seconds in totals.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=400, help="steps per kind of model")
    args = p.parse_args()
    mesh = one_process_mesh()
    rows = []
    for kind in ("plain", "FSDP", "TP"):
        ms = phase_ms(kind, mesh, args.steps)
        rows.append({"model": kind, **ms, "total": round(sum(ms.values()), 3)})
    dist.destroy_process_group()
    print(f"\nms per step, tiny model, batch 1, one CPU process, {args.steps} steps (the last 3/4 counted)")
    print("| model | " + " | ".join(PHASES) + " | total | vs plain |\n|---" * 1 + "|---" * (len(PHASES) + 2) + "|")
    for r in rows:
        cells = " | ".join(f"{r[phase]:.2f}" for phase in PHASES)
        print(f"| {r['model']} | {cells} | {r['total']:.2f} | {r['total'] / rows[0]['total']:.2f}× |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "phases.json"
    path.write_text(json.dumps({"torch": torch.__version__, "steps": args.steps, "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
