#!/usr/bin/env python
"""Speed of every training script on one GPU: tokens/s, MFU and peak memory, in one prepared run
of at most 8 minutes. Prints a table, writes benchmarks/results/gpu.json (and gpu.png when
matplotlib is there).

    python benchmarks/bench_gpu.py                  # on a machine with one CUDA GPU
    python benchmarks/bench_gpu.py --smoke          # the same runs, tiny and short, on the CPU: checks this file

What it runs (bf16 from accelerate_configs/gpu_single.yaml, world size 1; the sharded scripts
make their one-process group themselves, and leave out FSDP and TP, which have nothing to cut on
one rank, as torchtitan does):
  1. every training script: `gpt2` (85M), batch 8, `pystdlib` (1,024 tokens), 60 steps;
  2. train_ddp.py with and without --compile: `gpt2-medium` (303M), batch 16;
  3. the main job: train_ddp.py with its defaults (the README's first command, on one GPU).

Tokens/s and MFU are those of the runs' own train records, each a whole logging window timed
between two device synchronisations, averaged over the windows after the first two (start-up
and compilation left out). The goals on an H100/H200: every sharded script >= 0.9x DDP's
tokens/s; DDP --compile MFU >= 45% at gpt2-medium; the main job's step time at most 7.5 ms.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import ENV, REPO

RESULTS = REPO / "benchmarks" / "results"
SCRIPTS = ["train_ddp.py", "train_fsdp.py", "train_tp.py", "train_pp.py", "train_hybrid.py", "train_localsgd.py"]


def run(script: str, flags: list[str], out: Path, smoke: bool, timeout: float) -> dict:
    """One run; returns its steady-state figures (or the error)."""
    config = "cpu_single.yaml" if smoke else "gpu_single.yaml"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"accelerate_configs/{config}"]
    cmd += [f"scripts/{script}", *flags, "--output_dir", str(out), "--eval_every", "0"]
    start = time.perf_counter()
    timeout = 900 if smoke else timeout  # a loaded CPU is slow to start and to run
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:  # the others still run: the time budget is the whole file's
        return {"error": [f"timed out after {timeout:.0f} s"], "wall_s": round(time.perf_counter() - start, 1)}
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:], "wall_s": round(wall, 1)}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["type"] == "train"]
    summary = next(r for r in records if r["type"] == "summary")
    steady = train[2:] or train[-1:]
    tokens_per_sec = statistics.mean(r["tokens_per_sec"] for r in steady)
    mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
    tokens_per_step = summary["tokens_per_sec"] * summary["train_time_s"] / summary["steps"]
    evals = [r for r in records if r["type"] == "eval"]
    return {
        "tokens_per_sec": round(tokens_per_sec, 1),
        "mfu": round(statistics.mean(mfus), 4) if mfus else None,
        "ms_per_step": round(1000 * tokens_per_step / tokens_per_sec, 2),
        "peak_memory_mb": summary.get("peak_memory_mb_max_rank"),
        "wall_s": round(wall, 1),
        **({"exact_match": evals[-1].get("exact_match")} if evals else {}),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny and short, on the CPU: checks that every run works")
    p.add_argument("--steps", type=int, default=60, help="steps of each speed run")
    p.add_argument("--output", default=str(RESULTS / "gpu.json"), help="where to write the figures")
    args = p.parse_args()
    steps = 6 if args.smoke else args.steps
    model, medium = ("tiny", "tiny") if args.smoke else ("gpt2", "gpt2-medium")
    batch, medium_batch = (2, 2) if args.smoke else (8, 16)
    cpu = ["--cpu"] if args.smoke else []
    common = ["--dataset", "pystdlib", "--max_steps", str(steps), "--log_every", str(max(1, steps // 6)), *cpu]
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for script in SCRIPTS:  # 1. every script, world size 1
            extra = ["--n_microbatches", "1"] if script == "train_pp.py" else []
            flags = [*common, "--model_size", model, "--batch_size", str(batch), *extra]
            runs[script] = run(script, flags, Path(tmp) / script, args.smoke, timeout=150)
            print(f"{script}: {runs[script]}", flush=True)
        for name, extra in (("ddp gpt2-medium", []), ("ddp gpt2-medium --compile", ["--compile"])):  # 2.
            flags = [*common, "--model_size", medium, "--batch_size", str(medium_batch), *extra]
            runs[name] = run("train_ddp.py", flags, Path(tmp) / name.replace(" ", "_"), args.smoke, timeout=200)
            print(f"{name}: {runs[name]}", flush=True)
        main_flags = ["--max_steps", "30", *cpu] if args.smoke else []  # 3. the main job, its defaults
        runs["main job"] = run("train_ddp.py", [*main_flags, "--eval_every", "0"], Path(tmp) / "main", args.smoke, 200)
        print(f"main job: {runs['main job']}", flush=True)

    ddp = runs["train_ddp.py"].get("tokens_per_sec")
    print("\n| run | tokens/s | vs DDP | MFU | ms/step | peak MiB |")
    print("|---|---|---|---|---|---|")
    for name, r in runs.items():
        if "error" in r:
            print(f"| {name} | failed: {r['error']} |")
            continue
        vs = f"{r['tokens_per_sec'] / ddp:.2f}" if ddp and name in SCRIPTS else ""
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        print(f"| {name} | {r['tokens_per_sec']:,.0f} | {vs} | {mfu} | {r['ms_per_step']} | {r['peak_memory_mb']} |")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"smoke": args.smoke, "steps": steps, "runs": runs}, indent=1))
    print(f"wrote {args.output}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = [n for n in SCRIPTS if "tokens_per_sec" in runs[n]]
        fig, ax = plt.subplots(figsize=(7, 3))
        ax.bar(
            [n.removeprefix("train_").removesuffix(".py") for n in names], [runs[n]["tokens_per_sec"] for n in names]
        )
        ax.set_ylabel("tokens/s (one GPU)")
        fig.tight_layout()
        fig.savefig(Path(args.output).with_suffix(".png"))
    except ImportError:
        pass


if __name__ == "__main__":
    main()
