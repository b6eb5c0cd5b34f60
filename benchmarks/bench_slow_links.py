#!/usr/bin/env python
"""Slow links, measured as time: DDP, HSDP, DiLoCo and Streaming DiLoCo on 2 and 4 "machines" (network
namespaces, slurm/local_nodes.py) whose links are limited by `tc tbf` to 10, 20, 100 and 1,000 Mbit/s or
left unthrottled. `small` on pystdlib (128-token Python sources), the same tokens for every run: global batch
16 (`--global_batch_size`), the same steps, the same seed.

For each run: the training time per step (the summary's `train_time_s`: the steps themselves, fusions
included, not the start-up nor the final evaluation), the final validation loss (the whole split, after the
last fusion), whether it is within 2% of DDP's (the same machines; DDP's losses do not depend on the link),
the bytes each node's interface sent per step (its counters), and the train loss against wall-clock seconds
(`elapsed_s` in metrics.jsonl). The goals (issue 32): on 2 nodes at 10 and 20 Mbit/s, DiLoCo at K = 32 within
10% of its own unthrottled time per step and within 2% of DDP's final validation loss; DDP's slowdown beside
it. And `plan_layout.py --network`, given a preflight.json measured over the throttled link (scripts/preflight.py
run on the same nodes) and a compute time calibrated on the unthrottled run, predicts DDP's and HSDP's step time.

One process a node (HSDP: 2, sharding inside the node), so that 2 nodes do not oversubscribe 2 cores; 4 nodes
run 4 processes on them (their compute is slower, their links as throttled). HSDP needs 2 processes a node: on
4 nodes that is 8 processes on 2 cores, left out by default (--runs HSDP --nodes 4 runs it).

Time to DDP's loss: with --diloco_steps the DiLoCo runs train longer than DDP, evaluated every 8 steps, and
each is timed to its first evaluation within 2% of DDP's final validation loss (the training seconds until
then, `train_s` in metrics.jsonl). The overlapped runs (--overlap_steps) land each fusion τ steps after it
starts, whatever the link: their losses, like DDP's, are the same at every rate.

Prints a table, writes benchmarks/results/<--out>.json and, with matplotlib (benchmarks/requirements.txt),
benchmarks/results/<--out>.png. Needs root (network namespaces). About 45 minutes with the defaults on
2 cores; the time-to-loss runs below 37 on 2 nodes, then 25 on 4.

    sudo .venv/bin/python benchmarks/bench_slow_links.py [--nodes 2 4] [--steps 48] [--runs DDP "DiLoCo K=32"]
    sudo .venv/bin/python benchmarks/bench_slow_links.py --out slow_links_to_target --nodes 2 --rates 10mbit \
        20mbit none --diloco_steps 96 --no_prediction --runs DDP "DiLoCo K=32" "DiLoCo K=32 overlap 24" \
        "Streaming DiLoCo K=32 F=4 bf16 overlap 8"      # then --add with --nodes 4 --rates 10mbit none
    python benchmarks/bench_slow_links.py --report_only [--out slow_links_to_target]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import REPO

sys.path.insert(0, str(REPO / "slurm"))
import local_nodes

RESULTS = REPO / "benchmarks" / "results"
DILOCO = ["--outer_optimizer", "nesterov"]  # outer lr 0.7, momentum 0.9: the defaults
# name: (script, processes per node, flags)
RUNS = {
    "DDP": ("train_ddp.py", 1, []),
    "HSDP": ("train_fsdp.py", 2, []),  # --dp_replicate = nodes, added per run: shard inside a node
    "DiLoCo K=8": ("train_localsgd.py", 1, [*DILOCO, "--sync_every", "8"]),
    "DiLoCo K=32": ("train_localsgd.py", 1, [*DILOCO, "--sync_every", "32"]),
    "Streaming DiLoCo K=32 F=4 bf16": (
        "train_localsgd.py",
        1,
        [*DILOCO, "--sync_every", "32", "--fragments", "4", "--outer_dtype", "bf16"],
    ),
    # overlapped fusions: the all-reduce runs while the replicas take τ more steps (--overlap_steps)
    "DiLoCo K=32 overlap 24": ("train_localsgd.py", 1, [*DILOCO, "--sync_every", "32", "--overlap_steps", "24"]),
    "Streaming DiLoCo K=32 F=4 bf16 overlap 8": (
        "train_localsgd.py",
        1,
        [*DILOCO, "--sync_every", "32", "--fragments", "4", "--outer_dtype", "bf16", "--overlap_steps", "8"],
    ),
}
RATES = {2: ["10mbit", "20mbit", "100mbit", "1000mbit", "none"], 4: ["10mbit", "100mbit", "1000mbit", "none"]}
PREDICTED_RATES = ["20mbit", "100mbit"]  # where plan_layout.py --network is checked (2 nodes, DDP and HSDP)
GLOBAL_BATCH = 16


def mbit(rate: str) -> float | None:
    return None if rate == "none" else float(rate.removesuffix("mbit"))


def run_flags(name: str, n_nodes: int, args) -> tuple[str, int, list[str]]:
    script, per_node, extra = RUNS[name]
    world = n_nodes * per_node
    # DiLoCo may train longer than DDP (--diloco_steps): it is timed to the evaluation that reaches DDP's loss
    steps, evals = (args.diloco_steps, "8") if script == "train_localsgd.py" else (args.steps, "0")
    flags = ["--dataset", "pystdlib", "--model_size", "small", "--max_steps", str(steps), "--seed", "0"]
    flags += ["--batch_size", str(GLOBAL_BATCH // world), "--global_batch_size", str(GLOBAL_BATCH)]
    flags += ["--warmup_steps", "8", "--log_every", "2", "--eval_every", evals, "--collective_timeout", "900", *extra]
    if name == "HSDP":
        flags += ["--dp_replicate", str(n_nodes)]
    return script, per_node, flags


def measure(name: str, n_nodes: int, rate: str, args, tmp: Path) -> dict:
    script, per_node, flags = run_flags(name, n_nodes, args)
    out = tmp / f"{n_nodes}_{rate}_{name.replace(' ', '_').replace('=', '')}"
    with local_nodes.LocalNodes(n_nodes, rate=None if rate == "none" else rate) as nodes:
        result = nodes.run(f"scripts/{script}", [*flags, "--output_dir", str(out)], per_node, 3600, cwd=REPO)
    if result.returncode != 0 or result.timed_out:
        raise SystemExit(f"{name}, {n_nodes} nodes, {rate}: exit {result.returncode}\n{result.nodes[0].stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = next(r for r in records if r["type"] == "summary")
    final_eval = [r for r in records if r["type"] == "eval"][-1]
    return {
        "name": name,
        "nodes": n_nodes,
        "processes_per_node": per_node,
        "rate": rate,
        "steps": summary["steps"],
        "train_time_s": summary["train_time_s"],
        "step_s": summary["train_time_s"] / summary["steps"],
        "final_eval_loss": final_eval["eval_loss"],
        "tx_bytes_per_step_per_node": [n.tx_bytes / summary["steps"] for n in result.nodes],
        "wall_s": round(result.seconds, 1),
        "curve": [(r["elapsed_s"], r["loss"]) for r in records if r["type"] == "train"],
        "train_curve": [(r["step"], r["train_s"], r["loss"]) for r in records if r["type"] == "train"],
        "evals": [(r["step"], r["train_s"], r["eval_loss"]) for r in records if r["type"] == "eval"],
        "fusion_wait_s": summary.get("fusion_wait_s"),
    }


def plan(layout: list[str], world: int, per_node: int, network: Path | None, peak_tflops: float) -> dict:
    """plan_layout.py's figures for one layout of `small` at this batch (--json)."""
    cmd = [sys.executable, str(REPO / "scripts" / "plan_layout.py"), "--model_size", "small", "--seq_len", "128"]
    cmd += ["--world_size", str(world), "--gpus_per_node", str(per_node), "--pp_size", "1", "--tp_size", "1"]
    cmd += ["--batch_size", str(GLOBAL_BATCH // world), "--n_microbatches", "1", "--peak_tflops", str(peak_tflops)]
    cmd += [*layout, "--no_overlap", "--json", *(["--network", str(network)] if network else [])]  # CPUs: no overlap
    text = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO).stdout
    return json.loads(text[text.index("[{") :])[0]


def predict(results: list[dict], tmp: Path) -> list[dict]:
    """For DDP and HSDP on 2 nodes at PREDICTED_RATES: preflight.py measures the links on the throttled nodes
    (2 processes a node: the node's own loopback and the link), plan_layout.py --network plans with them, the
    compute calibrated so that the plan's compute equals the run's unthrottled step."""
    layouts = {
        "DDP": (["--dp_replicate", "2", "--dp_shard", "1"], 2, 1),
        "HSDP": (["--dp_replicate", "2", "--dp_shard", "2"], 4, 2),
    }
    rows = []
    for rate in PREDICTED_RATES:
        network = tmp / f"preflight_{rate}.json"
        check = ["--sizes", "256K,4M", "--iters", "2", "--timeout", "600", "--output", str(network)]
        with local_nodes.LocalNodes(2, rate=rate) as nodes:
            done = nodes.run("scripts/preflight.py", check, 2, 1200, cwd=REPO)
        if done.returncode != 0:
            raise SystemExit(f"preflight at {rate}: exit {done.returncode}\n{done.nodes[0].stderr[-3000:]}")
        inter = json.loads(network.read_text())["links"]["inter_node"]
        for name, (layout, world, per_node) in layouts.items():
            measured = {r["rate"]: r for r in results if r["name"] == name and r["nodes"] == 2}
            if rate not in measured or "none" not in measured:
                continue
            flops = plan(layout, world, per_node, None, 1.0)["compute_s"] * 1e12  # at 1 TFLOP/s
            peak = flops / measured["none"]["step_s"] / 1e12  # the CPU's effective rate on this run
            planned = plan(layout, world, per_node, network, peak)  # the links preflight.py measured
            # the link's own rate, as plan_layout.py counts links: per process (the node's processes share it)
            share = mbit(rate) / 8 / 1000 / per_node
            nominal = plan([*layout, "--inter_node_GBps", str(share)], world, per_node, None, peak)
            step = measured[rate]["step_s"]
            rows.append(
                {
                    "name": name,
                    "rate": rate,
                    "preflight_inter_node_GBps": inter["bandwidth_GBps"],
                    "rate_GBps_per_process": share,
                    "calibrated_peak_tflops": round(peak, 6),
                    "planned_step_s": planned["step_time_s"],
                    "planned_at_rate_step_s": nominal["step_time_s"],
                    "measured_step_s": round(step, 4),
                    "error": round(planned["step_time_s"] / step - 1, 4),
                    "error_at_rate": round(nominal["step_time_s"] / step - 1, 4),
                }
            )
    return rows


def ddp_target(results: list[dict], nodes: int, rate: str) -> float | None:
    """DDP's final validation loss on these nodes (the same at every rate: the same computation)."""
    losses = {r["rate"]: r["final_eval_loss"] for r in results if r["name"] == "DDP" and r["nodes"] == nodes}
    return losses.get(rate, losses.get("none"))


def time_to_target(run: dict, target: float | None) -> tuple[int, float] | None:
    """(step, training seconds) of the run's first evaluation within 2% of `target`; None if none is."""
    reached = [(step, train_s) for step, train_s, loss in run.get("evals", []) if target and loss <= 1.02 * target]
    return reached[0] if reached else None


def goals(results: list[dict]) -> list[dict]:
    """DiLoCo K=32 (synchronous and overlapped) and DDP on 2 nodes at 10 and 20 Mbit/s against their own
    unthrottled runs; the training seconds each takes to within 2% of DDP's final validation loss."""
    by = {(r["name"], r["nodes"], r["rate"]): r for r in results}
    rows = []
    for rate in ("10mbit", "20mbit"):
        ddp, ddp_free = by.get(("DDP", 2, rate)), by.get(("DDP", 2, "none"))
        for name in [n for n in RUNS if n.startswith("DiLoCo K=32")]:
            diloco, free = by.get((name, 2, rate)), by.get((name, 2, "none"))
            if not (diloco and ddp and free and ddp_free):
                continue
            target = ddp_target(results, 2, rate)
            reached = time_to_target(diloco, target)
            rows.append(
                {
                    "rate": rate,
                    "run": name,
                    "slowdown": round(diloco["step_s"] / free["step_s"], 3),
                    "within_10pct": diloco["step_s"] <= 1.10 * free["step_s"],
                    "final_loss_vs_ddp": round(diloco["final_eval_loss"] / target - 1, 4),
                    "reaches_2pct_at_step": reached and reached[0],
                    "seconds_to_2pct": reached and reached[1],
                    "ddp_seconds": ddp["train_time_s"],
                    "ddp_slowdown": round(ddp["step_s"] / ddp_free["step_s"], 3),
                }
            )
    return rows


def report(data: dict) -> None:
    results = data["runs"]
    longer = f", DiLoCo up to {data['diloco_steps']} (evaluated every 8)" if data.get("diloco_steps") else ""
    print(f"\nDDP and HSDP {data['steps']} steps{longer}; {GLOBAL_BATCH} x 128 tokens a step, small on pystdlib\n")
    print(
        "| nodes | link | run | s/step | train s | to DDP's loss (2%) | final val loss | vs DDP | MB sent/step/node |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        target = ddp_target(results, r["nodes"], r["rate"])
        gap = r["final_eval_loss"] / target - 1 if target else None
        reached = time_to_target(r, target) or (
            (r["steps"], r["train_time_s"]) if gap is not None and gap <= 0.02 else None
        )
        sent = max(r["tx_bytes_per_step_per_node"]) / 1e6
        to_target = f"{reached[1]:.1f} s (step {reached[0]})" if reached else "not reached"
        print(
            f"| {r['nodes']} | {r['rate']} | {r['name']} | {r['step_s']:.3f} | {r['train_time_s']:.1f} | "
            f"{to_target} | {r['final_eval_loss']:.4f} | "
            f"{'' if gap is None else f'{gap:+.2%}'} | {sent:.3f} |"
        )
    if data.get("goals") and "run" in data["goals"][0]:
        print(
            "\n| 2 nodes | run | vs its unthrottled step | within 10% | final loss vs DDP | to DDP's loss (2%) "
            "| DDP's time | DDP slowdown |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for g in data["goals"]:
            reached = (
                f"{g['seconds_to_2pct']:.1f} s (step {g['reaches_2pct_at_step']})" if g["seconds_to_2pct"] else "no"
            )
            print(
                f"| {g['rate']} | {g['run']} | {g['slowdown']:.3f}x | {g['within_10pct']} | "
                f"{g['final_loss_vs_ddp']:+.2%} | {reached} | {g['ddp_seconds']:.1f} s | {g['ddp_slowdown']:.1f}x |"
            )
    if data.get("predictions"):
        print(
            "\n| 2 nodes | run | measured s/step | plan, --network (preflight) | error | "
            "plan, the link's rate | error |"
        )
        print("|---|---|---|---|---|---|---|")
        for p in data["predictions"]:
            print(
                f"| {p['rate']} | {p['name']} | {p['measured_step_s']:.3f} | {p['planned_step_s']:.3f} "
                f"({p['preflight_inter_node_GBps']:.5f} GB/s) | {p['error']:+.1%} | {p['planned_at_rate_step_s']:.3f} "
                f"({p['rate_GBps_per_process']:.5f} GB/s) | {p['error_at_rate']:+.1%} |"
            )


def training_seconds(run: dict) -> list[tuple[float, float]] | None:
    """(training seconds, train loss) of a run: its train records' `train_s`; for results measured before they
    were kept, interpolated by step between the evaluations' (records every 2 steps). None for a run that
    stopped only for its last evaluation: its wall-clock is training time."""
    if run.get("train_curve"):
        return [(seconds, loss) for _, seconds, loss in run["train_curve"]]
    known = [(0, 0.0)] + [(step, seconds) for step, seconds, _ in run.get("evals", [])]
    if len(known) < 3:
        return None
    steps = [2 * (i + 1) for i in range(len(run["curve"]))]
    seconds = [
        next(t0 + (t1 - t0) * (s - s0) / (s1 - s0) for (s0, t0), (s1, t1) in zip(known, known[1:]) if s <= s1)
        for s in steps
    ]
    return [(t, loss) for t, (_, loss) in zip(seconds, run["curve"], strict=True)]


def plot(data: dict, name: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -r benchmarks/requirements.txt): no plot")
        return
    shown = [(2, "10mbit"), (2, "none"), (4, "10mbit")]
    fig, axes = plt.subplots(1, len(shown), figsize=(5 * len(shown), 4), sharey=True)
    # runs evaluated along the way are drawn against training seconds (the evaluations left out), as all
    evaluated = any(training_seconds(r) for r in data["runs"])
    for ax, (n_nodes, rate) in zip(axes, shown, strict=True):
        for r in data["runs"]:
            if r["nodes"] == n_nodes and r["rate"] == rate and r["curve"]:
                seconds, losses = zip(*(training_seconds(r) or r["curve"]), strict=True)
                ax.plot(seconds, losses, label=r["name"], color=f"C{list(RUNS).index(r['name'])}")  # one colour a run
        ax.set_title(f"{n_nodes} nodes, link {rate if rate != 'none' else 'unthrottled'}")
        ax.set_xlabel("training seconds (evaluations left out)" if evaluated else "wall-clock seconds of training")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("train loss")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=110)
    print(f"plot: {RESULTS / f'{name}.png'}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[2, 4], help="machines (namespaces): 2, 4")
    p.add_argument("--steps", type=int, default=48, help="optimizer steps of DDP and HSDP")
    p.add_argument(
        "--diloco_steps", type=int, help="optimizer steps of the DiLoCo runs, evaluated every 8 (default: --steps)"
    )
    p.add_argument("--runs", nargs="+", choices=list(RUNS), help="only these runs (default: all; HSDP on 2 nodes)")
    p.add_argument("--rates", nargs="+", help="only these link rates (e.g. 20mbit none)")
    p.add_argument("--no_prediction", action="store_true", help="skip preflight.py and plan_layout.py's prediction")
    p.add_argument("--out", default="slow_links", help="results file name in benchmarks/results/ (no suffix)")
    p.add_argument("--add", action="store_true", help="keep the other runs already in the results file")
    p.add_argument("--report_only", action="store_true", help="print the table of the results file (--out)")
    p.add_argument("--predict_only", action="store_true", help="only the predictions, for the runs in the results file")
    args = p.parse_args()
    args.diloco_steps = args.diloco_steps or args.steps
    path = RESULTS / f"{args.out}.json"
    if args.report_only:
        data = json.loads(path.read_text())
        report(data)
        plot(data, args.out)
        return 0
    reason = local_nodes.unavailable_reason()
    if reason:
        print(f"error: bench_slow_links.py: {reason}", file=sys.stderr)
        return 2
    if args.predict_only:
        data = json.loads(path.read_text())
        with tempfile.TemporaryDirectory() as tmp:
            data["predictions"] = predict(data["runs"], Path(tmp))
        path.write_text(json.dumps(data, indent=1) + "\n")
        report(data)
        return 0
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for n_nodes in args.nodes:
            for rate in RATES.get(n_nodes, RATES[2]):
                if args.rates and rate not in args.rates:
                    continue
                for name in args.runs or [n for n in RUNS if n != "HSDP" or n_nodes == 2]:
                    results.append(measure(name, n_nodes, rate, args, Path(tmp)))
                    r = results[-1]
                    print(
                        f"{n_nodes} nodes, {rate:>8}, {name:<31} {r['step_s']:.3f} s/step, "
                        f"val {r['final_eval_loss']:.4f}, {max(r['tx_bytes_per_step_per_node']) / 1e6:.3f} MB a step",
                        flush=True,
                    )
        predictions = [] if args.no_prediction or 2 not in args.nodes else predict(results, Path(tmp))
    if args.add and path.is_file():  # the runs measured before, but not again now
        before = json.loads(path.read_text())
        predictions = predictions or before.get("predictions", [])
        again = {(r["name"], r["nodes"], r["rate"]) for r in results}
        kept = [r for r in before["runs"] if (r["name"], r["nodes"], r["rate"]) not in again]
        order = {"rate": RATES[2], "name": list(RUNS)}  # nodes, then rate, then run, as measured
        results = sorted(
            kept + results,
            key=lambda r: (r["nodes"], order["rate"].index(r["rate"]), order["name"].index(r["name"])),
        )
    data = {"steps": args.steps, "diloco_steps": args.diloco_steps, "global_batch": GLOBAL_BATCH, "runs": results}
    data["goals"] = goals(results)
    data["predictions"] = predictions
    RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    report(data)
    plot(data, args.out)
    print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
