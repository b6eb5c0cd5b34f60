#!/usr/bin/env python
"""Model fusion measured on language modelling: DDP against Local SGD (`average`), DiLoCo (`nesterov`)
and Streaming DiLoCo (`--fragments`), on `pystdlib` (Python sources, 128-token sequences), the `small`
model, 2 and 4 CPU processes. Every run takes the same inner (AdamW) steps on the same tokens: the
global batch is fixed, so 4 processes take half the samples each that 2 do.

For each run: the final validation loss (the whole validation split, after the last fusion), the bytes
each rank sends per step (ring all-reduce: 2(N-1)/N x the buffer), and the peak bytes of one fusion.
Prints a table, writes benchmarks/results/localsgd.json and, where matplotlib is installed
(benchmarks/requirements.txt), benchmarks/results/localsgd.png (loss against bytes). About 55 minutes
with the defaults on 2 cores shared with other jobs (18 runs).

    python benchmarks/bench_localsgd.py [--nprocs 2 4] [--ks 8 32 128] [--steps 512]
    python benchmarks/bench_localsgd.py --report_only
"""

import argparse
import json
import math
import tempfile
from pathlib import Path

from harness import REPO, accelerate_cmd, run_quiet

RESULTS = REPO / "benchmarks" / "results"


def runs_to_make(ks: list[int], streaming_k: int, fragments: int) -> list[tuple[str, str, list[str]]]:
    """(name, script, flags) of every run, for one number of processes."""
    diloco = ["--outer_optimizer", "nesterov"]  # outer lr 0.7, momentum 0.9: the defaults
    streaming = [*diloco, "--sync_every", str(streaming_k), "--fragments", str(fragments)]
    return [
        ("DDP", "scripts/train_ddp.py", []),
        *[(f"average K={k}", "scripts/train_localsgd.py", ["--sync_every", str(k)]) for k in ks],
        *[(f"DiLoCo K={k}", "scripts/train_localsgd.py", [*diloco, "--sync_every", str(k)]) for k in ks],
        (f"Streaming DiLoCo K={streaming_k} F={fragments}", "scripts/train_localsgd.py", streaming),
        (
            f"Streaming DiLoCo K={streaming_k} F={fragments} bf16",
            "scripts/train_localsgd.py",
            [*streaming, "--outer_dtype", "bf16"],
        ),
    ]


def measure(name: str, script: str, flags: list[str], nproc: int, args, tmp: Path) -> dict:
    out = tmp / f"{nproc}_{name.replace(' ', '_').replace('=', '')}"
    common = [
        "--dataset",
        "pystdlib",
        "--model_size",
        "small",
        "--batch_size",
        str(args.global_batch // nproc),
        "--max_steps",
        str(args.steps),
        "--eval_every",
        "0",
        "--log_every",
        "16",
        "--output_dir",
        str(out),
    ]
    run_quiet(accelerate_cmd(script, [*common, *flags], nproc=nproc))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary, final = records[-1], [r for r in records if r["type"] == "eval"][-1]
    if script.endswith("train_ddp.py"):
        per_step = summary["gradient_allreduce_mib_per_step_per_rank"]
        peak, calls = per_step, args.steps  # every step is an all-reduce of the whole model's gradients
    else:
        per_step, peak, calls = (
            summary["allreduce_mib_per_step_per_rank"],
            summary["peak_fusion_mib_per_rank"],
            summary["fusion_allreduce_calls"],
        )
    return {
        "run": name,
        "nproc": nproc,
        "final_eval_loss": final["eval_loss"],
        "mib_per_step_per_rank": per_step,
        "total_mib_per_rank": round(per_step * args.steps, 3),
        "peak_mib_per_fusion_per_rank": peak,
        "allreduce_calls": calls,
        "train_loss": [(r["step"], r["loss"]) for r in records if r["type"] == "train"],
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nprocs", type=int, nargs="+", default=[2, 4])
    p.add_argument("--ks", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument("--streaming_k", type=int, default=32)
    p.add_argument("--fragments", type=int, default=4)
    p.add_argument("--steps", type=int, default=512)
    p.add_argument("--global_batch", type=int, default=16, help="sequences per optimizer step, over all processes")
    p.add_argument("--report_only", action="store_true", help="redo the table and plot from the last results file")
    args = p.parse_args()
    if args.report_only:
        report(json.loads((RESULTS / "localsgd.json").read_text()))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for nproc in args.nprocs:
            for name, script, flags in runs_to_make(args.ks, args.streaming_k, args.fragments):
                rows.append(measure(name, script, flags, nproc, args, Path(tmp)))
                print({k: v for k, v in rows[-1].items() if k != "train_loss"}, flush=True)
    saved = {
        "task": "pystdlib, small model (0.88M), 128-token sequences, AdamW 1e-3 inner",
        "steps": args.steps,
        "global_batch": args.global_batch,
        "rows": rows,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "localsgd.json").write_text(json.dumps(saved, indent=1) + "\n")
    report(saved)


def report(saved: dict) -> None:
    rows = saved["rows"]
    print(f"pystdlib, small, {saved['steps']} steps of {saved['global_batch']} sequences")
    print("| processes | run | final eval loss | vs DDP | MiB / step / rank | less than DDP | peak MiB per fusion |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ddp = next(d for d in rows if d["nproc"] == r["nproc"] and d["run"] == "DDP")
        less = ddp["mib_per_step_per_rank"] / r["mib_per_step_per_rank"]
        print(
            f"| {r['nproc']} | {r['run']} | {r['final_eval_loss']:.4f} "
            f"| {100 * (r['final_eval_loss'] / ddp['final_eval_loss'] - 1):+.1f}% "
            f"| {r['mib_per_step_per_rank']:.4f} | {less:.0f}x | {r['peak_mib_per_fusion_per_rank']:.3f} |"
        )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install -r benchmarks/requirements.txt)")
        return
    nprocs = sorted({r["nproc"] for r in rows})
    fig, axes = plt.subplots(1, len(nprocs), figsize=(5.5 * len(nprocs), 4), squeeze=False)
    for ax, nproc in zip(axes[0], nprocs):
        mine = [r for r in rows if r["nproc"] == nproc]
        for family, marker in (("average", "o-"), ("DiLoCo", "s-")):
            series = sorted((r for r in mine if r["run"].startswith(family)), key=lambda r: r["mib_per_step_per_rank"])
            ax.plot(
                [r["total_mib_per_rank"] for r in series],
                [r["final_eval_loss"] for r in series],
                marker,
                label=family + " (K = " + ", ".join(r["run"].split("=")[1] for r in series[::-1]) + ")",
            )
        markers = iter(["^", "v", "D"])
        for r in mine:
            if r["run"] == "DDP" or r["run"].startswith("Streaming"):
                marker = "*" if r["run"] == "DDP" else next(markers)
                ax.plot(r["total_mib_per_rank"], r["final_eval_loss"], marker, ms=10, label=r["run"])
        finite = [r["final_eval_loss"] for r in mine if math.isfinite(r["final_eval_loss"])]
        ax.set(
            xscale="log",
            xlabel="MiB sent per rank, whole run",
            ylabel="final validation loss",
            title=f"{nproc} processes",
            ylim=(min(finite) - 0.05, max(finite) + 0.05),
        )
        ax.legend(fontsize=8)
    fig.suptitle(f"pystdlib, small model, {saved['steps']} steps: validation loss against bytes communicated")
    fig.tight_layout()
    fig.savefig(RESULTS / "localsgd.png", dpi=100)
    print(f"written {RESULTS / 'localsgd.json'} and {RESULTS / 'localsgd.png'}")


if __name__ == "__main__":
    main()
