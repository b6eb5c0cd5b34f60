#!/usr/bin/env python
"""Measures scripts/train_ddp.py: time to accuracy, scaling 1 -> 2 processes, and speed against the
plain-PyTorch recipe (benchmarks/plain_ddp.py). Prints the figures and writes them to
benchmarks/results/ddp.json. Takes ~10 minutes on a 2-core machine.

    python benchmarks/bench_ddp.py [--steps 300] [--repeats 2]

Throughput is tokens over training-step time (data loading included; evaluation, start-up and
the first 20 steps left out), the same measurement for both recipes.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness import REPO, accelerate_cmd, free_port, run_quiet

RESULTS = REPO / "benchmarks" / "results" / "ddp.json"


def accelerate_launch(nproc: int, script: str, args: list[str]) -> float:
    """Run and return the wall-clock seconds of the whole command."""
    cmd = [sys.executable, script, *args] if nproc == 1 else accelerate_cmd(script, args, nproc)
    start = time.perf_counter()
    run_quiet(cmd)
    return time.perf_counter() - start


def steady_tokens_per_sec(metrics_file: Path, skip_steps: int = 20) -> float:
    """Tokens/s over the train records after the first `skip_steps` (windows of equal token count)."""
    records = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    rates = [r["tokens_per_sec"] for r in records if r["type"] == "train" and r["step"] > skip_steps]
    return len(rates) / sum(1 / r for r in rates)


def train_ddp_speed(tmp: Path, nproc: int, steps: int, tag: str) -> float:
    out = tmp / tag
    accelerate_launch(
        nproc,
        "scripts/train_ddp.py",
        [
            "--max_steps",
            str(steps),
            "--eval_every",
            "0",
            "--batch_size",
            "64",
            "--log_every",
            "10",
            "--output_dir",
            str(out),
            "--overwrite_output_dir",
        ],
    )
    return steady_tokens_per_sec(out / "metrics.jsonl")


def plain_ddp_speed(tmp: Path, steps: int, tag: str) -> float:
    out = tmp / f"{tag}.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        "benchmarks/plain_ddp.py",
        "--max_steps",
        str(steps),
        "--batch_size",
        "64",
        "--output_file",
        str(out),
    ]
    run_quiet(cmd)
    return json.loads(out.read_text())["tokens_per_sec"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--repeats", type=int, default=2, help="runs of each speed measurement (median reported)")
    args = p.parse_args()
    results = {"machine": f"{os.cpu_count()} cores", "model": "small", "data": "addition", "batch_size_per_rank": 64}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # 1. The README's main job (2 processes, defaults), evaluated every 50 steps.
        out = tmp / "main_job"
        wall = accelerate_launch(2, "scripts/train_ddp.py", ["--eval_every", "50", "--output_dir", str(out)])
        evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"eval"' in line]
        first = next((e for e in evals if e["exact_match"] >= 0.95), None)
        results["main_job"] = {
            "wall_clock_s": round(wall, 1),
            "final_exact_match": evals[-1]["exact_match"],
            "step_reaching_95pct": first and first["step"],
            "in_run_s_to_95pct": first and first["elapsed_s"],
        }
        print("main job:", results["main_job"], flush=True)
        # 2. and 3. Speed, interleaved so that machine noise hits every recipe alike.
        speeds = {"train_ddp_1proc": [], "train_ddp_2proc": [], "plain_ddp_2proc": []}
        for i in range(args.repeats):
            speeds["train_ddp_1proc"].append(train_ddp_speed(tmp, 1, args.steps, f"one_{i}"))
            speeds["train_ddp_2proc"].append(train_ddp_speed(tmp, 2, args.steps, f"two_{i}"))
            speeds["plain_ddp_2proc"].append(plain_ddp_speed(tmp, args.steps, f"plain_{i}"))
            print({k: v[-1] for k, v in speeds.items()}, flush=True)
    median = {k: round(statistics.median(v), 1) for k, v in speeds.items()}
    results["tokens_per_sec"] = median
    results["tokens_per_sec_runs"] = speeds
    results["scaling_2proc_over_1proc"] = round(median["train_ddp_2proc"] / median["train_ddp_1proc"], 3)
    results["train_ddp_over_plain_ddp"] = round(median["train_ddp_2proc"] / median["plain_ddp_2proc"], 3)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))
    print(f"written to {RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
