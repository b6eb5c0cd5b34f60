#!/usr/bin/env python
"""How often a finished multi-process run exits non-zero: each multi-process script, N times (default
30) on 2 or 4 ranks with the tiny model for 2 steps, counting exit codes other than 0. Prints a
table, writes benchmarks/results/exits.json. A run takes 10 to 20 s on 2 idle cores: 30 runs of
each script take about 25 minutes with --parallel 2.

    python benchmarks/bench_exits.py [--runs 30] [--scripts train_fsdp train_tp] [--parallel 2]

Every run is a complete, correct run: what is counted is the exit, through Python's normal
shutdown. `--parallel K` starts K runs at a time: the abort this measures (docs/fault-tolerance.md,
"Clean exits") came more often on a loaded machine.
"""

import argparse
import json
import subprocess
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness import ENV, REPO, accelerate_cmd

RESULTS = REPO / "benchmarks" / "results"
TINY = ["--model_size", "tiny", "--max_steps", "2", "--eval_every", "0", "--eval_batch_size", "250"]
# (script, ranks, its flags): every multi-process script, the sharded ones with DeviceMesh sub-groups
CASES = {
    "train_ddp": (2, []),
    "train_localsgd": (2, []),
    "train_fsdp": (2, []),
    "train_tp": (2, []),
    "train_pp": (2, []),
    "train_hybrid": (4, ["--dp_shard", "2", "--tp_size", "2"]),
}


def run_once(script: str, nproc: int, flags: list[str], out: Path) -> tuple[int, str]:
    """One run; returns its exit code and, when it is not 0, the last lines of its output."""
    cmd = accelerate_cmd(f"scripts/{script}.py", [*TINY, *flags, "--output_dir", str(out)], nproc)
    env = {**ENV, "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    tail = "" if result.returncode == 0 else "\n".join((result.stdout + result.stderr).splitlines()[-5:])
    return result.returncode, tail


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=30, help="runs per script")
    p.add_argument("--scripts", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--parallel", type=int, default=1, help="runs at a time (a loaded machine)")
    args = p.parse_args()
    start, rows = time.monotonic(), []
    with tempfile.TemporaryDirectory() as tmp:
        for script in args.scripts:
            nproc, flags = CASES[script]
            codes, seconds, tails = Counter(), time.monotonic(), []
            with ThreadPoolExecutor(args.parallel) as pool:
                runs = pool.map(lambda i: run_once(script, nproc, flags, Path(tmp) / f"{script}_{i}"), range(args.runs))
                for code, tail in runs:
                    codes[code] += 1
                    if tail:
                        tails.append(tail)
            rows.append(
                {
                    "script": script,
                    "ranks": nproc,
                    "runs": args.runs,
                    "non_zero_exits": args.runs - codes[0],
                    "exit_codes": {str(k): v for k, v in sorted(codes.items())},
                    "seconds_per_run": round((time.monotonic() - seconds) / args.runs, 1),  # wall time / runs
                    "first_failure": tails[0] if tails else None,
                }
            )
            print(f"{script}: {rows[-1]['non_zero_exits']} of {args.runs} non-zero", flush=True)
    total_s = round(time.monotonic() - start)
    print("\n| script | ranks | runs | non-zero exits | exit codes | s/run |\n|---|---|---|---|---|---|")
    for r in rows:
        codes = ", ".join(f"{k}: {v}" for k, v in r["exit_codes"].items())
        print(
            f"| {r['script']} | {r['ranks']} | {r['runs']} | {r['non_zero_exits']} | {codes} | {r['seconds_per_run']} |"
        )
    mode = f"{args.parallel} run(s) at a time"
    print(f"\n{mode}; {sum(r['non_zero_exits'] for r in rows)} non-zero of {sum(r['runs'] for r in rows)}; {total_s} s")
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "exits.json"
    # a run of some --scripts replaces their rows and keeps the others'
    kept = json.loads(path.read_text())["scripts"] if path.exists() else []
    rows = [r for r in kept if r["script"] not in args.scripts] + rows
    total = round(sum(r["seconds_per_run"] * r["runs"] for r in rows))
    path.write_text(json.dumps({"mode": mode, "total_seconds": total, "scripts": rows}, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
