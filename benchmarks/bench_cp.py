#!/usr/bin/env python
"""What context parallelism (scripts/train_cp.py's ring attention) costs and saves, on the CPU (gloo):

1. activation memory per rank at one long sequence (--seq_len, default 8192 tokens, the `tiny` GPT with
   that context), for cp = 1, 2, 4: the bytes autograd keeps for backward after the forward
   (torch.autograd.graph.saved_tensors_hooks, each storage counted once): the activation peak, which
   backward then frees. Expected: proportional to 1/cp;
2. bytes each rank sent around the ring in one step (forward and backward), against the formula:
   per layer (cp-1) K/V blocks forward, (cp-1) K/V + cp dK/dV blocks backward;
3. time of a forward + backward at the same tokens per rank (--tokens_per_rank, default 2048: sequences
   of 2048 x cp), with the transfers overlapping the compute and without (each transfer waited for
   before computing): what the overlap hides. On 2 cores, 4 ranks share them: indicative only;
4. the same three figures for Ulysses (train_cp.py --cp_impl ulysses) beside the ring: activations at
   --seq_len, the all-to-all buffers each rank sent against the formula (per layer q, k, v and the output,
   forward and backward, each b x s/cp x d; (cp-1)/cp of it leaves the rank), and the step time at the
   same tokens per rank (sequences of 4k and 8k tokens at cp 2 and 4): fused attention on whole sequences;
5. attention alone (forward + backward, --tokens_per_rank per rank): the ring, whose blocks are fused kernel
   calls, against the fused one-process kernel (causal SDPA) on the same attention FLOPs per rank, run on
   every rank at once so that both meet the same load. The goal: the ring at most 1.3x.

    python benchmarks/bench_cp.py [--seq_len 8192] [--tokens_per_rank 2048] [--iters 3]

Prints a table and writes benchmarks/results/cp.json. Each cp runs as its own torchrun job of cp processes.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
RESULTS = REPO / "benchmarks" / "results"
MIB = 2**20


def saved_bytes(run) -> int:
    """Bytes autograd keeps for backward while `run()` builds the graph (each storage once)."""
    import torch

    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return sum(storages.values()), out


def attention_seconds(group, cp: int, tokens: int, iters: int) -> dict:
    """Attention alone, forward + backward, on every rank of the job at once (4 heads x 16 dims, the tiny
    GPT's): the ring over the cp ranks, `tokens` per rank in head-tail chunks; and, on the same ranks, the
    fused one-process kernel (causal SDPA) on the same attention FLOPs per rank: cp sequences of `tokens`
    (the ring's rank computes 2cp + 1 blocks of (tokens/2)², two of them causal: cp x tokens²/2 scores
    per head, as cp causal sequences of `tokens` do). Alternated, the fastest of `iters` each (after a
    warm-up): both meet the same load on the shared cores."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from train_cp import RingAttention

    from common.context_parallel import head_tail_chunks
    from common.cp_comms import Ring

    heads, head_dim = 4, 16

    def timed(batch: int, attend) -> float:
        q, k, v, dout = (torch.randn(batch, heads, tokens, head_dim, requires_grad=i < 3) for i in range(4))
        dist.barrier(group)
        start = time.perf_counter()
        attend(q, k, v).backward(dout)
        return time.perf_counter() - start

    def ring(q, k, v):
        return RingAttention.apply(q, k, v, Ring(group, head_tail_chunks(cp)))

    def fused(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    times = {"ring": [], "fused": []}
    for _ in range(iters + 1):
        if cp > 1:
            times["ring"].append(timed(1, ring))
        times["fused"].append(timed(cp, fused))
    return {f"attention_s_{name}": min(t[1:]) for name, t in times.items() if t}


def worker(args) -> None:
    """One rank of a cp-rank job: memory at --seq_len, bytes sent, times at --tokens_per_rank."""
    import torch
    import torch.distributed as dist
    from train_cp import ring_attention, ulysses_attention

    from common.context_parallel import cp_chunks, rank_positions
    from common.cp_comms import Ring, Ulysses
    from common.cp_costs import ring_bytes_per_step, ulysses_bytes_per_step
    from common.model import GPT, GPTConfig, GPTTask

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cp, rank = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(cp)))  # the ring's own group, as a CP group of the training mesh
    result = {"cp": cp}

    def step(seq_len: int, overlap: bool, measure_memory: bool = False, impl: str = "ring"):
        torch.manual_seed(0)
        cfg = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=seq_len)
        model, task = GPT(cfg), GPTTask(cfg, seq_len, "text")
        chunks_of, ring = cp_chunks(cp, impl), None
        if cp > 1 and impl == "ulysses":
            ring = Ulysses(group, chunks_of)
            task.set_attention(model, ulysses_attention(ring))
        elif cp > 1:
            ring = Ring(group, chunks_of, overlap=overlap)
            task.set_attention(model, ring_attention(ring))
        ids = torch.randint(0, 256, (1, seq_len))
        pos = rank_positions(seq_len, chunks_of[rank], sum(map(len, chunks_of)))
        targets = task.next_token_targets({"labels": ids})[:, pos]

        def forward():
            return task.loss_at(model, ids[:, pos], targets, pos)[0]

        dist.barrier()
        start = time.perf_counter()
        kept, loss = saved_bytes(forward) if measure_memory else (0, forward())
        loss.backward()
        seconds = time.perf_counter() - start
        return kept, seconds, ring, cfg

    from common.layout import Layout

    layout = Layout(cp=cp, world_size=cp)
    kept, _, ring, cfg = step(args.seq_len, True, measure_memory=True)
    result["activation_mib"] = kept / MIB
    if ring:
        result["sent_mib"] = {k: v / MIB for k, v in ring.sent_bytes.items()}
        formula = ring_bytes_per_step(layout, 1, args.seq_len, cfg.n_embd, cfg.n_layer, 1)
        result["formula_mib"] = {k: v / MIB for k, v in formula.items()}
    for overlap in (True, False) if cp > 1 else (True,):
        times = [step(args.tokens_per_rank * cp, overlap)[1] for _ in range(args.iters + 1)][1:]  # 1 warm-up
        result["step_s_overlap" if overlap else "step_s_no_overlap"] = min(times)
    if cp > 1:  # Ulysses beside the ring: the same model, sequence and tokens per rank
        kept, _, ulysses, cfg = step(args.seq_len, True, measure_memory=True, impl="ulysses")
        result["ulysses_activation_mib"] = kept / MIB
        result["ulysses_sent_mib"] = {k: v / MIB for k, v in ulysses.sent_bytes.items()}
        shapes = {"q_width": cfg.n_embd, "width": cfg.n_embd, "layers": cfg.n_layer}
        formula = ulysses_bytes_per_step(layout, 1, args.seq_len, shapes, 1)
        result["ulysses_formula_mib"] = {k: v / MIB for k, v in formula.items()}
        times = [step(args.tokens_per_rank * cp, True, impl="ulysses")[1] for _ in range(args.iters + 1)][1:]
        result["ulysses_step_s"] = min(times)
    result |= attention_seconds(group, cp, args.tokens_per_rank, args.iters)  # attention alone, ring vs fused
    every = [None] * cp
    dist.all_gather_object(every, result)
    if rank == 0:
        merged = {
            "cp": cp,
            "activation_mib_per_rank_max": max(r["activation_mib"] for r in every),
            "step_s_overlap_max_rank": max(r["step_s_overlap"] for r in every),
            "attention_s_fused_max_rank": max(r["attention_s_fused"] for r in every),
        }
        if cp > 1:
            merged["step_s_no_overlap_max_rank"] = max(r["step_s_no_overlap"] for r in every)
            merged["attention_s_ring_max_rank"] = max(r["attention_s_ring"] for r in every)
            merged["attention_ring_vs_fused"] = round(
                merged["attention_s_ring_max_rank"] / merged["attention_s_fused_max_rank"], 3
            )
            merged["sent_mib_per_rank"] = every[0]["sent_mib"]
            merged["formula_mib_per_rank"] = every[0]["formula_mib"]
            merged["ulysses"] = {
                "activation_mib_per_rank_max": max(r["ulysses_activation_mib"] for r in every),
                "step_s_max_rank": max(r["ulysses_step_s"] for r in every),
                "all_to_all_buffers_mib_per_rank": every[0]["ulysses_sent_mib"],
                "formula_mib_per_rank": every[0]["ulysses_formula_mib"],
                "leaves_rank_mib_per_rank": {k: v * (cp - 1) / cp for k, v in every[0]["ulysses_sent_mib"].items()},
            }
        print("RESULT " + json.dumps(merged))
    dist.destroy_process_group()


def launch(cp: int, args) -> dict:
    sys.path.insert(0, str(REPO / "benchmarks"))
    from harness import free_port

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(cp),
        "--master_port",
        str(free_port()),
    ]
    flags = ["--seq_len", str(args.seq_len), "--tokens_per_rank", str(args.tokens_per_rank), "--iters", str(args.iters)]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([*cmd, __file__, "--worker", *flags], capture_output=True, text=True, env=env, cwd=REPO)
    if out.returncode:
        sys.exit(f"cp {cp} failed:\n{out.stderr[-3000:]}")
    return json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq_len", type=int, default=8192, help="tokens of the sequence for the memory figure")
    p.add_argument("--tokens_per_rank", type=int, default=2048, help="tokens per rank for the time figures")
    p.add_argument("--iters", type=int, default=3, help="timed steps (the fastest counts), after one warm-up")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    rows = [launch(cp, args) for cp in (1, 2, 4)]
    base = rows[0]
    print(f"bench_cp: tiny GPT (2 layers x 64, 4 heads), fp32, CPU/gloo, batch 1; memory at {args.seq_len} tokens")
    print("  cp  activations/rank  x cp (vs cp 1)  sent fwd/bwd MiB (formula)      step s (overlap / none)  hidden")
    for r in rows:
        ratio = r["activation_mib_per_rank_max"] * r["cp"] / base["activation_mib_per_rank_max"]
        r["activation_times_cp_vs_cp1"] = round(ratio, 4)
        sent = formula = "-"
        hidden = ""
        if r["cp"] > 1:
            s, f = r["sent_mib_per_rank"], r["formula_mib_per_rank"]
            sent = f"{s['forward']:.2f} / {s['backward']:.2f}"
            formula = f"({f['forward']:.2f} / {f['backward']:.2f})"
            saved = r["step_s_no_overlap_max_rank"] - r["step_s_overlap_max_rank"]
            r["overlap_hides_s"] = round(saved, 4)
            hidden = f"{saved:+.3f} s"
        none = f"{r['step_s_no_overlap_max_rank']:.3f}" if r["cp"] > 1 else "-"
        print(
            f"  {r['cp']:>2}  {r['activation_mib_per_rank_max']:>12.2f} MiB  {ratio:>13.3f}  {sent:>13} "
            f"{formula:>15}  {r['step_s_overlap_max_rank']:>8.3f} / {none:>6}  {hidden}"
        )
    print(
        f"  time: forward + backward of one sequence of {args.tokens_per_rank} x cp tokens "
        f"({args.tokens_per_rank} per rank)"
    )
    print("  Ulysses beside the ring (the same model, sequence and tokens per rank):")
    print(
        "  cp  tokens  activations/rank (ring)  sent fwd+bwd MiB: ring / Ulysses buffers (leave)"
        "  step s: ring / Ulysses"
    )
    for r in rows[1:]:
        u, cp = r["ulysses"], r["cp"]
        ring_sent = sum(r["sent_mib_per_rank"].values())
        buffers, leave = sum(u["all_to_all_buffers_mib_per_rank"].values()), sum(u["leaves_rank_mib_per_rank"].values())
        print(
            f"  {cp:>2}  {args.tokens_per_rank * cp:>6}  {u['activation_mib_per_rank_max']:>8.2f} MiB "
            f"({r['activation_mib_per_rank_max']:.2f})  {ring_sent:>8.2f} / {buffers:.2f} ({leave:.2f})"
            f"{'':>24}{r['step_s_overlap_max_rank']:>6.3f} / {u['step_s_max_rank']:.3f}"
        )
    print(
        f"  attention alone, forward + backward, {args.tokens_per_rank} tokens per rank, 4 heads x 16 dims, every "
        "rank at once: the ring vs the fused kernel (causal SDPA) on the same FLOPs per rank (cp sequences)"
    )
    print("  cp  ring s  fused s  ring / fused (goal <= 1.3)")
    for r in rows:
        ring = f"{r['attention_s_ring_max_rank']:.3f}" if r["cp"] > 1 else "-"
        ratio = f"{r['attention_ring_vs_fused']:.2f}" if r["cp"] > 1 else "-"
        print(f"  {r['cp']:>2}  {ring:>6}  {r['attention_s_fused_max_rank']:>7.3f}  {ratio:>5}")
    record = {"seq_len_memory": args.seq_len, "tokens_per_rank_time": args.tokens_per_rank, "runs": rows}
    record["measured_with"] = "autograd saved-tensor hooks (bytes kept for backward); time.perf_counter per step"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cp.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {RESULTS / 'cp.json'}")


if __name__ == "__main__":
    main()
