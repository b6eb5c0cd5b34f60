#!/usr/bin/env python
"""Mixture of experts and expert parallelism, measured on CPUs (scripts/train_ep.py, docs/ep.md).

1. Load balance over a 500-step run: the `tiny` GPT with 8 experts, top-2, in both blocks, on 2
   processes (ep 2, 32 samples per rank), for no balancing, the aux-loss-free bias and the aux loss
   (and the bias with --capacity_factor 1, which drops what overflows): max / mean tokens per expert,
   per MoE layer and step, over the whole global batch (train_ep.py's `expert_load` records).
2. Loss: the dense `tiny` model (MLP 4 x 64 wide) against those MoE models, whose two chosen experts
   of 128 each give a token the same active MLP (train_ddp.py for the dense one, same global batch).
3. All-to-all: rank 0's bytes of the first step against the formula tokens x top_k x n_embd x 4 bytes
   x 2 (dispatch, combine) x 2 (forward, backward) x MoE layers, at ep 2 and ep 4, and at ep 2 on 4
   processes; and the share of the step time spent in it (torch.profiler around 20 steps of
   train_ep.py's own dispatch and combine).
4. Expert memory per rank, measured, against plan_layout.py --n_experts (at ep 2 on 4 processes
   FSDP cuts each rank's experts again over the 2 groups: half the bytes of ep 2 on 2).

Prints the figures, writes benchmarks/results/ep.json and, where matplotlib is installed
(benchmarks/requirements.txt), benchmarks/results/ep_balance.png. About 7 minutes on 2 cores.

    python benchmarks/bench_ep.py [--steps 500]
    python benchmarks/bench_ep.py --all_to_all_only     # parts 3 and 4 only (about 2 minutes)
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import ENV, REPO, accelerate_cmd, free_port, run_quiet

RESULTS = REPO / "benchmarks" / "results"
MODEL = ["--model_size", "tiny", "--batch_size", "32", "--eval_every", "100", "--log_every", "1"]
MOE = ["--n_experts", "8", "--top_k", "2"]
BALANCE = {
    "none": ["--load_balance", "none"],
    "aux_free": ["--load_balance", "aux_free"],
    "aux_loss": ["--load_balance", "aux_loss", "--aux_loss_coef", "0.01"],
    "aux_free, capacity 1.0": ["--load_balance", "aux_free", "--capacity_factor", "1.0"],
}


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def train(script: str, out: Path, flags: list[str], nproc: int = 2) -> list[dict]:
    run_quiet(accelerate_cmd(script, [*MODEL, *flags, "--output_dir", str(out)], nproc=nproc))
    return records(out)


def balance_figures(recs: list[dict]) -> dict:
    train_recs = [r for r in recs if r["type"] == "train"]
    loads = [r["expert_load"] for r in train_recs]  # per step, per layer: max / mean
    n_layers = len(loads[0])
    last = loads[-100:]
    return {
        "max_over_mean_per_layer_last_100_steps": [
            round(sum(step[i] for step in last) / len(last), 3) for i in range(n_layers)
        ],
        "max_over_mean_per_layer_worst": [round(max(step[i] for step in loads), 3) for i in range(n_layers)],
        "curve": [[r["step"], *r["expert_load"]] for r in train_recs],
        "eval": [[r["step"], r["eval_loss"], r["exact_match"]] for r in recs if r["type"] == "eval"],
        "tokens_per_sec": recs[-1]["tokens_per_sec"],
        **(
            {"dropped_share_mean": round(sum(sum(r["dropped_share"]) for r in train_recs) / n_layers / len(loads), 4)}
            if "dropped_share" in train_recs[0]
            else {}
        ),
    }


def profile_share(ep: int, nproc: int) -> dict:
    """This file as a worker under torchrun: the share of the step time in the all-to-alls."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(free_port()),
        str(Path(__file__).resolve()),
        "--worker",
        "--ep",
        str(ep),
    ]
    out = subprocess.run(cmd, cwd=REPO, env=ENV, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def worker(ep: int, steps: int = 20, warmup: int = 5) -> None:
    """train_ep.py's strategy on the MoE model of this benchmark, 20 profiled steps after 5 of warm-up:
    the CPU time in the token all-to-alls (forward and backward, waits included) and in the counts'
    all-to-all, against the wall time of the steps. Rank 0 prints one JSON line."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.profiler import ProfilerActivity, profile, record_function

    sys.path.insert(0, str(REPO / "scripts"))
    import train_ep

    from common.layout import Layout
    from common.model import GPT, GPTConfig
    from common.moe import moe_layers

    class TimedCounts:  # train_ep.py's `dist`, with the counts' all-to-all marked for the profiler
        def __getattr__(self, name):
            return getattr(dist, name)

        def all_to_all_single(self, *args, **kwargs):
            with record_function("ep::counts_all_to_all"):
                return dist.all_to_all_single(*args, **kwargs)

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    train_ep.dist = TimedCounts()
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny", n_experts=8, top_k=2))
    layout = Layout.from_degrees(world, dp_replicate=world // ep)
    layout.build_mesh("cpu")
    experts = [m.experts for m in moe_layers(model)]
    train_ep.apply_expert_parallel(experts, layout.sub("dp_shard"))
    train_ep.shard_expert_slices(experts, layout.sub("dp_replicate"), world)
    for unit in [*model.blocks.values(), model]:
        fully_shard(unit, mesh=layout.sub("dp"), reshard_after_forward=unit is not model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(dist.get_rank())
    batch = torch.randint(0, 256, (32, 13), generator=generator)

    def step():
        logits = model(batch)
        torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 256), batch[:, 1:].reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(warmup):
        step()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        wall = time.perf_counter() - start
    names = ("_c10d_functional::all_to_all_single", "_c10d_functional::wait_tensor", "ep::counts_all_to_all")
    a2a_us = sum(e.cpu_time_total for e in prof.key_averages() if e.key in names)
    shares = torch.tensor([a2a_us / 1e6 / wall, wall / steps])
    dist.all_reduce(shares)
    shares /= world
    if dist.get_rank() == 0:
        print(
            json.dumps(
                {
                    "ep": ep,
                    "processes": world,
                    "all_to_all_share": round(shares[0].item(), 4),
                    "step_ms": round(shares[1].item() * 1e3, 2),
                }
            )
        )
    dist.destroy_process_group()


def plan(ep: int, world: int, per_rank: int) -> dict:
    sys.path.insert(0, str(REPO / "scripts"))
    import plan_layout

    argv = ["--model_size", "tiny", "--world_size", str(world), "--n_experts", "8", "--top_k", "2"]
    args = plan_layout.build_args().parse_args(
        [*argv, "--batch_size", str(per_rank), "--seq_len", "13", "--ep_size", str(ep)]
    )
    cfg = plan_layout.moe_config(args)
    args.peak_tflops = plan_layout.PEAK_TFLOPS["no"]
    return plan_layout.plan_ep(cfg, args, ep, plan_layout.link_settings(args))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ep", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--report_only", action="store_true", help="redo the table and plot from the last results file")
    p.add_argument(
        "--all_to_all_only",
        action="store_true",
        help="redo only the all-to-all and memory rows (keeps the balance runs)",
    )
    args = p.parse_args()
    if args.worker:
        return worker(args.ep)
    if args.report_only:
        report(json.loads((RESULTS / "ep.json").read_text()))
        return
    started = time.perf_counter()
    steps = ["--max_steps", str(args.steps)]
    result = {"command": "python benchmarks/bench_ep.py --steps " + str(args.steps), "balance": {}, "all_to_all": []}
    if args.all_to_all_only:
        result = json.loads((RESULTS / "ep.json").read_text()) | {"all_to_all": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name, flags in {} if args.all_to_all_only else BALANCE.items():
            out = tmp / name.replace(" ", "_").replace(",", "").replace(".", "")
            result["balance"][name] = balance_figures(train("scripts/train_ep.py", out, [*steps, *MOE, *flags]))
            result["balance"][name]["n_params"] = records(out)[-1]["n_params"]
            print(name, result["balance"][name]["max_over_mean_per_layer_last_100_steps"], flush=True)
        if not args.all_to_all_only:
            dense = train("scripts/train_ddp.py", tmp / "dense", steps)
            result["dense"] = {
                "n_params": dense[-1]["n_params"],
                "eval": [[r["step"], r["eval_loss"], r["exact_match"]] for r in dense if r["type"] == "eval"],
                "tokens_per_sec": dense[-1]["tokens_per_sec"],
            }
        # (ep, processes, samples per rank): ep 2 on 4 processes cuts each rank's experts again over 2 groups
        layouts = ((2, 2, 32), (4, 4, 16), (2, 4, 16))
        summaries = {}
        for ep, nproc, per_rank in layouts:
            flags = ["--max_steps", "5", *MOE, "--batch_size", str(per_rank), "--ep_size", str(ep)]
            summaries[ep, nproc] = train("scripts/train_ep.py", tmp / f"ep{ep}x{nproc}", flags, nproc=nproc)[-1]
    for ep, nproc, per_rank in layouts:
        summary = summaries[ep, nproc]
        planned = plan(ep, nproc, per_rank)
        formula = per_rank * 13 * 2 * 64 * 4 * 2 * 2 * planned["moe_layers"]
        measured = summary["collectives_first_step_rank0"]["all_to_all"]["mib"] * 2**20
        result["all_to_all"].append(
            {
                "ep": ep,
                "processes": nproc,
                "samples_per_rank": per_rank,
                "first_step_bytes_rank0": round(measured),
                "formula_bytes": formula,
                "measured_over_formula": round(measured / formula, 3),
                "expert_param_bytes_per_rank": summary["expert_param_bytes_per_rank"],
                "planned_expert_param_bytes_per_rank": planned["expert_param_bytes_per_rank"],
                **profile_share(ep, nproc),
            }
        )
        print(result["all_to_all"][-1], flush=True)
    result["all_to_all_seconds" if args.all_to_all_only else "seconds"] = round(time.perf_counter() - started)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ep.json").write_text(json.dumps(result, indent=1))
    report(result)


def report(result: dict) -> None:
    print("\nload balance (max / mean tokens per expert, per layer; mean of the last 100 of the steps):")
    dense_final = result["dense"]["eval"][-1]
    print(
        f"  {'dense (no experts)':<24} eval_loss {dense_final[1]:.4f}  exact {dense_final[2]:.3f}  "
        f"{result['dense']['n_params'] / 1e6:.2f}M params"
    )
    for name, b in result["balance"].items():
        final = b["eval"][-1]
        print(
            f"  {name:<24} eval_loss {final[1]:.4f}  exact {final[2]:.3f}  {b['n_params'] / 1e6:.2f}M params  "
            f"load {b['max_over_mean_per_layer_last_100_steps']} (worst {b['max_over_mean_per_layer_worst']})"
            + (f"  dropped {100 * b['dropped_share_mean']:.1f}% of token copies" if "dropped_share_mean" in b else "")
        )
    print("all-to-all (first step, rank 0) and expert memory per rank:")
    for a in result["all_to_all"]:
        print(
            f"  ep {a['ep']} on {a['processes']}: {a['first_step_bytes_rank0'] / 2**20:.3f} MiB"
            f" vs formula {a['formula_bytes'] / 2**20:.3f}"
            f" MiB ({a['measured_over_formula']}x); {100 * a['all_to_all_share']:.1f}% of a {a['step_ms']} ms step;"
            f" experts {a['expert_param_bytes_per_rank'] / 2**20:.3f} MiB per rank, plan"
            f" {a['planned_expert_param_bytes_per_rank'] / 2**20:.3f} MiB"
        )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot; pip install -r benchmarks/requirements.txt)")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, b in result["balance"].items():
        curve = b["curve"]
        window = 20
        for layer in range(len(curve[0]) - 1):
            values = [c[layer + 1] for c in curve]
            smooth = [
                sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
                for i in range(len(values))
            ]
            axes[0].plot(
                [c[0] for c in curve], smooth, label=f"{name}, layer {layer}", linestyle="-" if layer == 0 else "--"
            )
        axes[1].plot([e[0] for e in b["eval"]], [e[1] for e in b["eval"]], marker="o", label=name)
    dense = result["dense"]["eval"]
    axes[1].plot([e[0] for e in dense], [e[1] for e in dense], marker="s", color="black", label="dense")
    axes[0].set(
        xlabel="step", ylabel="max / mean tokens per expert (20-step mean)", title="load balance, 8 experts, top-2"
    )
    axes[1].set(xlabel="step", ylabel="eval loss", title="same active parameters", yscale="log")
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "ep_balance.png", dpi=110)
    print(f"plot: {RESULTS / 'ep_balance.png'}")


if __name__ == "__main__":
    main()
