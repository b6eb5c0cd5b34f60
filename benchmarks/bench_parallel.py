#!/usr/bin/env python
"""What the sharded strategies cost, measured on the `small` model (4 layers x 128, 0.88M
parameters, AdamW, fp32): memory per rank under FSDP, communication per step under TP, the
pipeline bubble and activation memory under PP. Prints three tables, writes
benchmarks/results/parallel.json. About 5 minutes on 2 cores.

    python benchmarks/bench_parallel.py [--steps 30]

All figures come from the runs' own summary records (metrics.jsonl): bytes are counted
exactly from the local shards, collectives are counted on one step, the bubble is
1 - (time the stage computed) / (time of the step). On a 2-core CPU, runs with more ranks
than cores share them, so times (bubble, tokens/s) are only indicative there; the byte counts
do not depend on the machine.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

from harness import REPO, accelerate_cmd, run_quiet

RESULTS = REPO / "benchmarks" / "results"
MIB = 2**20


def run(script: str, nproc: int, out: Path, extra: list[str], steps: int) -> dict:
    args = ["--model_size", "small", "--max_steps", str(steps), "--eval_every", "0", "--log_every", str(steps)]
    cmd = accelerate_cmd(f"scripts/{script}", [*args, "--output_dir", str(out), *extra], nproc)
    run_quiet(cmd, PYTHONWARNINGS="ignore")
    return next(json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"summary"' in line)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    results = {"fsdp": [], "tp": [], "pp": []}
    with tempfile.TemporaryDirectory() as tmp:

        def go(name, script, nproc, extra):
            s = run(script, nproc, Path(tmp) / name, extra, args.steps)
            print(f"{name}: done", flush=True)
            return s

        for nproc in (2, 4):  # ---------------------------------------------------- FSDP memory
            s = go(f"fsdp{nproc}", "train_fsdp.py", nproc, ["--batch_size", str(64 // nproc)])
            st = s["state_bytes_per_rank_max"]
            results["fsdp"].append(
                {
                    "ranks": nproc,
                    "param_mib": st["param_bytes"] / MIB,
                    "grad_mib": st["grad_bytes"] / MIB,
                    "optim_mib": st["optimizer_bytes"] / MIB,
                    "total_mib": st["total_bytes"] / MIB,
                    "ddp_mib": s["ddp_state_bytes_per_rank"]["total_bytes"] / MIB,
                    "ideal_mib": s["ideal_state_bytes_per_rank"] / MIB,
                    "vs_ideal": s["state_vs_ideal"],
                    "peak_rss_mb": s["peak_memory_mb_max_rank"],
                    "tokens_per_sec": s["tokens_per_sec"],
                    "collectives": s["collectives_first_step_rank0"],
                }
            )
        for flags in (
            [],
            ["--sequence_parallel"],
            ["--loss_parallel"],
            ["--sequence_parallel", "--loss_parallel"],
        ):  # ---- TP communication
            name = "tp2" + "".join(f.replace("--", "_") for f in flags)
            s = go(name, "train_tp.py", 2, ["--batch_size", "64", "--addition_digits", "4", *flags])
            results["tp"].append(
                {
                    "flags": " ".join(flags) or "(none)",
                    "param_mib": s["state_bytes_per_rank_max"]["param_bytes"] / MIB,
                    "unsharded_param_mib": s["unsharded_param_bytes"] / MIB,
                    "collectives": s["collectives_first_step_rank0"],
                    "megatron_allreduces": s["megatron_allreduces_per_step"],
                    "megatron_mib_each": s["megatron_allreduce_mib_each"],
                    "tokens_per_sec": s["tokens_per_sec"],
                }
            )
        for schedule, m, v in (
            ("gpipe", 2, 1),
            ("gpipe", 4, 1),
            ("gpipe", 8, 1),
            ("1f1b", 4, 1),
            ("1f1b", 8, 1),
            ("interleaved_1f1b", 4, 2),
            ("interleaved_1f1b", 8, 2),
            ("zero_bubble", 4, 2),
        ):  # ---- PP bubble
            s = go(
                f"pp2_{schedule}_{m}",
                "train_pp.py",
                2,
                ["--batch_size", "64", "--schedule", schedule, "--n_microbatches", str(m), "--stages_per_rank", str(v)],
            )
            results["pp"].append(
                {
                    "schedule": schedule,
                    "microbatches": m,
                    "stages_per_rank": v,
                    "bubble_theory": s["bubble_theory"],
                    "bubble_measured": s["bubble_measured_per_rank"],
                    "in_flight": s["max_microbatches_in_flight_per_rank"],
                    "peak_activation_mib": s["peak_activation_mib_per_rank"],
                    "tokens_per_sec": s["tokens_per_sec"],
                }
            )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "parallel.json").write_text(
        json.dumps({"steps": args.steps, "model": "small", **results}, indent=1) + "\n"
    )
    report(results)


def report(results: dict) -> None:
    print("\nFSDP, small, AdamW fp32: bytes per rank (largest rank), counted from the local shards")
    print(
        "| ranks | params MiB | grads MiB | Adam MiB | total MiB | DDP MiB | ZeRO-3 ideal (DDP/N) | measured / ideal "
        "| peak RSS MB | tokens/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results["fsdp"]:
        print(
            f"| {r['ranks']} | {r['param_mib']:.3f} | {r['grad_mib']:.3f} | {r['optim_mib']:.3f} "
            f"| {r['total_mib']:.3f} | {r['ddp_mib']:.3f} | {r['ideal_mib']:.3f} | {r['vs_ideal']:.4f} "
            f"| {r['peak_rss_mb']:.0f} | {r['tokens_per_sec']:.0f} |"
        )
    print("\nTP 2 ranks, small, b=64, s=16: collectives of one training step (rank 0), beside Megatron's count")
    print(
        "| flags | params MiB / rank (unsharded) | measured collectives: calls (MiB) "
        "| Megatron: all-reduces x MiB | tokens/s |"
    )
    print("|---|---|---|---|---|")
    for r in results["tp"]:
        comm = ", ".join(f"{k} {v['calls']} ({v['mib']:.2f})" for k, v in r["collectives"].items())
        print(
            f"| {r['flags']} | {r['param_mib']:.3f} ({r['unsharded_param_mib']:.3f}) | {comm} "
            f"| {r['megatron_allreduces']} x {r['megatron_mib_each']:.3f} | {r['tokens_per_sec']:.0f} |"
        )
    print("\nPP 2 stages, small, batch 64: bubble (idle fraction) and activation memory per stage")
    print(
        "| schedule | micro-batches | stages/rank | bubble theory | bubble measured (stage 0, 1) "
        "| max micro-batches in flight | peak activation MiB | tokens/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results["pp"]:
        fmt = lambda xs, f: ", ".join(f.format(x) for x in xs)  # noqa: E731
        print(
            f"| {r['schedule']} | {r['microbatches']} | {r['stages_per_rank']} | {r['bubble_theory']:.3f} "
            f"| {fmt(r['bubble_measured'], '{:.3f}')} | {fmt(r['in_flight'], '{}')} "
            f"| {fmt(r['peak_activation_mib'], '{:.2f}')} | {r['tokens_per_sec']:.0f} |"
        )


if __name__ == "__main__":
    if "--report_only" in sys.argv:
        report(json.loads((RESULTS / "parallel.json").read_text()))
    else:
        main()
