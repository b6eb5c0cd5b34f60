#!/usr/bin/env python
"""Local SGD's trade-off, measured: the README's main job (2 processes, `small`, `addition`,
1,500 AdamW steps) with the parameters fused every K = 1, 4, 16 steps, beside DDP. Prints a
table, writes benchmarks/results/localsgd.json and, where matplotlib is installed
(benchmarks/requirements.txt), benchmarks/results/localsgd.png. About 8 minutes on 2 cores.

    python benchmarks/bench_localsgd.py [--ks 1 4 16] [--steps 1500]
"""

import argparse
import json
import tempfile
from pathlib import Path

from harness import REPO, accelerate_cmd, run_quiet

RESULTS = REPO / "benchmarks" / "results"


def run(script: str, out: Path, extra: list[str]) -> list[dict]:
    """On the 2 processes of cpu_multi.yaml."""
    run_quiet(accelerate_cmd(script, ["--eval_every", "100", "--output_dir", str(out), *extra]))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ks", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--report_only", action="store_true", help="redo the table and plot from the last results file")
    args = p.parse_args()
    if args.report_only:
        saved = json.loads((RESULTS / "localsgd.json").read_text())
        report(saved["rows"], saved["curves"])
        return
    rows, curves = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        runs = [("DDP", "scripts/train_ddp.py", [])] + [
            (f"Local SGD K={k}", "scripts/train_localsgd.py", ["--sync_every", str(k)]) for k in args.ks
        ]
        for name, script, extra in runs:
            records = run(
                script, Path(tmp) / name.replace(" ", "_").replace("=", ""), ["--max_steps", str(args.steps), *extra]
            )
            evals = [r for r in records if r["type"] == "eval"]
            final, summary = evals[-1], records[-1]
            per_step = summary.get(
                "allreduce_mib_per_step_per_rank", summary.get("gradient_allreduce_mib_per_step_per_rank")
            )
            rows.append(
                {
                    "run": name,
                    "final_eval_loss": final["eval_loss"],
                    "final_exact_match": final["exact_match"],
                    "allreduce_mib_per_step_per_rank": per_step,
                    "tokens_per_sec": summary["tokens_per_sec"],
                }
            )
            curves[name] = [(e["step"], e["eval_loss"], e["exact_match"]) for e in evals]
            print(rows[-1], flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "localsgd.json").write_text(
        json.dumps({"steps": args.steps, "rows": rows, "curves": curves}, indent=1) + "\n"
    )
    report(rows, curves)


def report(rows: list[dict], curves: dict) -> None:
    print(
        "| run | all-reduce MiB / step / rank | tokens/s | eval loss @ 500 | exact match @ 500 | @ 800 "
        "| first step ≥ 95% | final eval loss | final exact match |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        at = {step: (loss, em) for step, loss, em in curves[r["run"]]}
        first95 = next((step for step, _, em in curves[r["run"]] if em >= 0.95), None)
        print(
            f"| {r['run']} | {r['allreduce_mib_per_step_per_rank']:.3f} | {r['tokens_per_sec']:.0f} "
            f"| {at[500][0]:.3f} | {at[500][1]:.3f} | {at[800][1]:.3f} "
            f"| {first95} | {r['final_eval_loss']:.1e} | {r['final_exact_match']:.3f} |"
        )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install -r benchmarks/requirements.txt)")
        return
    fig, (ax_loss, ax_em) = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, points in curves.items():
        steps, losses, ems = zip(*points)
        ax_loss.plot(steps, losses, label=name)
        ax_em.plot(steps, ems, label=name)
    ax_loss.set(yscale="log", xlabel="step", ylabel="validation loss")
    ax_em.set(xlabel="step", ylabel="exact match")
    ax_em.legend()
    fig.suptitle("addition, small model, 2 CPU processes: DDP vs Local SGD (evaluated every 100 steps)")
    fig.tight_layout()
    fig.savefig(RESULTS / "localsgd.png", dpi=100)
    print(f"written {RESULTS / 'localsgd.json'} and {RESULTS / 'localsgd.png'}")


if __name__ == "__main__":
    main()
