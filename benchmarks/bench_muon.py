#!/usr/bin/env python
"""Muon against AdamW (--optimizer muon | adamw), on the CPU (gloo):

1. quality: `pystdlib` (Python sources, 128-token sequences), the `small` model, 2 processes (DDP), the
   same steps on the same tokens; a learning-rate sweep of 3 values for each optimizer (Muon's matrices
   take 0.2·sqrt(max(A, B)) x the rate, so one grid serves both). For each run: the training loss along
   the run (against steps and against training seconds) and the final validation loss;
2. overhead: the step time of each optimizer on DDP 2, FSDP 2 and TP 2 (the `small` model, the mean of
   the steps after the first few): what gathering the cut matrices and repeating Newton–Schulz on every
   rank costs. On 2 cores, 2 ranks share them: indicative only.

Prints two tables, writes benchmarks/results/muon.json and, where matplotlib is installed
(benchmarks/requirements.txt), benchmarks/results/muon.png (loss against steps and against seconds).
About 15 minutes with the defaults on 2 cores.

    python benchmarks/bench_muon.py [--steps 300] [--lrs 3e-4 1e-3 3e-3] [--overhead_steps 100]
    python benchmarks/bench_muon.py --overhead_only    # part 2 again (about 4 minutes)
    python benchmarks/bench_muon.py --report_only
"""

import argparse
import json
import tempfile
from pathlib import Path

from harness import REPO, accelerate_cmd, run_quiet

RESULTS = REPO / "benchmarks" / "results"
OPTIMIZERS = ("adamw", "muon")
TASK = "pystdlib, small model, 128-token sequences, 2 processes (DDP), global batch 16"
LAYOUTS = {"DDP 2": "scripts/train_ddp.py", "FSDP 2": "scripts/train_fsdp.py", "TP 2": "scripts/train_tp.py"}


def run(script: str, flags: list[str], out: Path) -> list[dict]:
    common = ["--dataset", "pystdlib", "--model_size", "small", "--eval_every", "0", "--output_dir", str(out)]
    run_quiet(accelerate_cmd(script, [*common, *flags], nproc=2))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def quality(optimizer: str, lr: float, args, tmp: Path) -> dict:
    flags = ["--optimizer", optimizer, "--learning_rate", str(lr), "--max_steps", str(args.steps)]
    flags += ["--batch_size", "8", "--warmup_steps", str(args.steps // 10), "--log_every", "10"]
    records = run("scripts/train_ddp.py", flags, tmp / f"{optimizer}_{lr}")
    train = [r for r in records if r["type"] == "train"]
    return {
        "optimizer": optimizer,
        "learning_rate": lr,
        "final_eval_loss": [r for r in records if r["type"] == "eval"][-1]["eval_loss"],
        "train_loss": [(r["step"], r["train_s"], r["loss"]) for r in train],
    }


def overhead(layout: str, optimizer: str, args, tmp: Path) -> dict:
    flags = ["--optimizer", optimizer, "--max_steps", str(args.overhead_steps), "--log_every", "1"]
    flags += ["--batch_size", "8" if layout != "TP 2" else "16", "--warmup_steps", "5", "--skip_cut_check"]
    records = run(LAYOUTS[layout], flags, tmp / f"{layout.replace(' ', '')}_{optimizer}")
    seconds = [r["train_s"] for r in records if r["type"] == "train"]
    skip = 5  # the first steps: allocations, the first gathers
    step_s = (seconds[-1] - seconds[skip - 1]) / (len(seconds) - skip)  # records keep 10 ms: a mean of many
    return {"layout": layout, "optimizer": optimizer, "step_s": step_s}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lrs", type=float, nargs="+", default=[3e-4, 1e-3, 3e-3])
    p.add_argument("--overhead_steps", type=int, default=100)
    p.add_argument("--report_only", action="store_true", help="redo the tables and plot from the last results file")
    p.add_argument("--overhead_only", action="store_true", help="measure part 2 again, keep part 1's results")
    args = p.parse_args()
    if args.report_only:
        report(json.loads((RESULTS / "muon.json").read_text()))
        return
    with tempfile.TemporaryDirectory() as tmp:
        if args.overhead_only:  # the quality runs kept from the last results file
            saved = json.loads((RESULTS / "muon.json").read_text())
        else:
            rows = [quality(o, lr, args, Path(tmp)) for o in OPTIMIZERS for lr in args.lrs]
            saved = {"task": TASK, "steps": args.steps, "quality": rows}
        saved["overhead"] = [overhead(layout, o, args, Path(tmp)) for layout in LAYOUTS for o in OPTIMIZERS]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "muon.json").write_text(json.dumps(saved, indent=1) + "\n")
    report(saved)


def report(saved: dict) -> None:
    print(f"{saved['task']}, {saved['steps']} steps")
    print("| optimizer | learning rate | final eval loss | train loss at the end | training seconds |")
    print("|---|---|---|---|---|")
    for r in saved["quality"]:
        step, seconds, loss = r["train_loss"][-1]
        print(
            f"| {r['optimizer']} | {r['learning_rate']:g} | {r['final_eval_loss']:.4f} | {loss:.4f} | {seconds:.0f} |"
        )
    print("| layout | AdamW s/step | Muon s/step | Muon / AdamW |")
    print("|---|---|---|---|")
    for layout in dict.fromkeys(r["layout"] for r in saved["overhead"]):
        adamw, muon = (
            next(r for r in saved["overhead"] if r["layout"] == layout and r["optimizer"] == o) for o in OPTIMIZERS
        )
        print(f"| {layout} | {adamw['step_s']:.4f} | {muon['step_s']:.4f} | {muon['step_s'] / adamw['step_s']:.2f} |")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install -r benchmarks/requirements.txt)")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in saved["quality"]:
        style = "-" if r["optimizer"] == "muon" else "--"
        label = f"{r['optimizer']} lr {r['learning_rate']:g}"
        steps, seconds, losses = zip(*r["train_loss"], strict=True)
        axes[0].plot(steps, losses, style, label=label)
        axes[1].plot(seconds, losses, style, label=label)
    axes[0].set(xlabel="optimizer steps", ylabel="training loss", title="at equal steps")
    axes[1].set(xlabel="training seconds", ylabel="training loss", title="at equal wall-clock")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.suptitle(saved["task"])
    fig.tight_layout()
    fig.savefig(RESULTS / "muon.png", dpi=100)
    print(f"written {RESULTS / 'muon.json'} and {RESULTS / 'muon.png'}")


if __name__ == "__main__":
    main()
