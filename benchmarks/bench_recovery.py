#!/usr/bin/env python
"""What each failure costs: steps lost and seconds from the failure to training again, for every
case docs/fault-tolerance.md describes. Each case runs once: train_ddp.py (train_fsdp.py for the kill
in a save) on 2 processes, tiny model, a checkpoint every 10 steps; the failure strikes at step 15
or later; the run is relaunched (or restarted by torchrun) with `--resume_from_checkpoint auto`,
and the clock stops at its first train record (the one marked "resumed"). Prints a table, writes
benchmarks/results/recovery.json. 11 minutes on 2 heavily loaded cores.

    python benchmarks/bench_recovery.py [--collective_timeout 10]

- steps_lost: steps run after the newest complete checkpoint, which the resumed run runs again;
- detect_s: from the failure until the job has ended (the frozen peer: the collective timeout);
- to_training_s: from the failure until the resumed run logs its first step. Relaunching is
  immediate here; a scheduler adds its own delay.
"""

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from harness import ENV, REPO, accelerate_cmd, free_port

RESULTS = REPO / "benchmarks" / "results"
EVERY, STRIKE = 10, 15  # checkpoint every 10 steps; the failure comes once step 15 is logged
FLAGS = ["--model_size", "tiny", "--max_steps", "200", "--batch_size", "8", "--log_every", "1", "--eval_every", "0"]
FLAGS += ["--checkpoint_every", str(EVERY), "--warmup_steps", "5", "--resume_from_checkpoint", "auto"]


def start(cmd: list[str]) -> subprocess.Popen:
    env = {**ENV, "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )


def records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]  # a line being written is skipped


def wait_for(condition, proc: subprocess.Popen | None = None, timeout: float = 600) -> float:
    """Poll `condition()` every 10 ms; returns the time it held."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline or (proc is not None and proc.poll() not in (None, 0)):
            raise RuntimeError("the run did not get there")
        time.sleep(0.01)
    return time.monotonic()


def logged_step(out: Path) -> int:
    return max((r["step"] for r in records(out) if r["type"] == "train"), default=0)


def workers(proc: subprocess.Popen, script: str) -> list[psutil.Process]:
    found = [p for p in psutil.Process(proc.pid).children(recursive=True) if script in " ".join(p.cmdline())]
    return sorted(found, key=lambda p: int(p.environ().get("RANK", "0")))


def stop_tree(proc: subprocess.Popen) -> None:
    procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def resumed(out: Path) -> bool:
    return any(r.get("resumed") for r in records(out))


def relaunch_until_training(script: str, out: Path, failed_at: float, extra: list[str]) -> dict:
    """Relaunch with auto; stop it once it logged its first step. Returns the figures of the case."""
    before = [r for r in records(out) if r["type"] == "train"]
    proc = start(accelerate_cmd(f"scripts/{script}", [*FLAGS, *extra, "--output_dir", str(out)], 2))
    try:
        back = wait_for(lambda: resumed(out), proc)
    finally:
        stop_tree(proc)
    first = next(r for r in records(out) if r.get("resumed"))
    return {"steps_lost": max(r["step"] for r in before) - (first["step"] - 1), "to_training_s": back - failed_at}


def crash_and_auto_resume(out: Path, timeout: float) -> dict:
    """Every process SIGKILLed (a machine lost, an OOM kill), the job relaunched by hand or a script."""
    proc = start(accelerate_cmd("scripts/train_ddp.py", [*FLAGS, "--output_dir", str(out)], 2))
    wait_for(lambda: logged_step(out) >= STRIKE, proc)
    stop_tree(proc)
    failed_at = time.monotonic()
    return {"detect_s": 0.0, **relaunch_until_training("train_ddp.py", out, failed_at, [])}


def torchrun_restart(out: Path, timeout: float) -> dict:
    """One rank SIGKILLed; torchrun --max_restarts restarts every worker on its own."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--max_restarts", "1"]
    cmd += ["--master_port", str(free_port()), "scripts/train_ddp.py", *FLAGS, "--output_dir", str(out)]
    proc = start(cmd)
    try:
        wait_for(lambda: logged_step(out) >= STRIKE, proc)
        before = logged_step(out)
        workers(proc, "train_ddp.py")[-1].send_signal(signal.SIGKILL)
        failed_at = time.monotonic()
        back = wait_for(lambda: resumed(out), proc)
    finally:
        stop_tree(proc)
    first = next(r for r in records(out) if r.get("resumed"))
    return {"detect_s": None, "steps_lost": before - (first["step"] - 1), "to_training_s": back - failed_at}


def preemption(out: Path, timeout: float) -> dict:
    """SIGTERM to the workers (SLURM, Kubernetes): they checkpoint at the next step and exit 0."""
    proc = start(accelerate_cmd("scripts/train_ddp.py", [*FLAGS, "--output_dir", str(out)], 2))
    wait_for(lambda: logged_step(out) >= STRIKE, proc)
    for worker in workers(proc, "train_ddp.py"):
        worker.send_signal(signal.SIGTERM)
    failed_at = time.monotonic()
    if proc.wait(timeout=300) != 0:
        raise RuntimeError("a preempted run must exit 0")
    detect = time.monotonic() - failed_at
    return {"detect_s": detect, **relaunch_until_training("train_ddp.py", out, failed_at, [])}


def kill_during_save(out: Path, timeout: float) -> dict:
    """Rank 1 SIGKILLed while the step-20 checkpoint is written (FSDP: each rank writes its shards)."""
    proc = start(accelerate_cmd("scripts/train_fsdp.py", [*FLAGS, "--output_dir", str(out)], 2))
    tmp = out / "checkpoints" / f".tmp_step_{2 * EVERY}"
    wait_for(tmp.is_dir, proc)
    workers(proc, "train_fsdp.py")[-1].send_signal(signal.SIGKILL)
    failed_at = time.monotonic()
    proc.wait(timeout=300)
    detect = time.monotonic() - failed_at
    if (out / "checkpoints" / f"step_{2 * EVERY}").exists():
        raise RuntimeError("the save completed before the kill: rerun")
    return {"detect_s": detect, **relaunch_until_training("train_fsdp.py", out, failed_at, [])}


def frozen_peer(out: Path, timeout: float) -> dict:
    """Rank 1 frozen (SIGSTOP: its connections stay open, nothing answers): rank 0 fails after
    --collective_timeout with one line; the job is then ended and relaunched."""
    extra = ["--collective_timeout", f"{timeout:g}"]
    proc = start(accelerate_cmd("scripts/train_ddp.py", [*FLAGS, *extra, "--output_dir", str(out)], 2))
    wait_for(lambda: logged_step(out) >= STRIKE, proc)
    rank0, rank1 = workers(proc, "train_ddp.py")
    rank1.suspend()
    failed_at = time.monotonic()
    psutil.wait_procs([rank0], timeout=timeout + 120)
    detect = time.monotonic() - failed_at
    stop_tree(proc)  # what a scheduler does once a job fails; the frozen rank ignores SIGTERM
    return {"detect_s": detect, **relaunch_until_training("train_ddp.py", out, failed_at, extra)}


CASES = {
    "crash, relaunch with auto": crash_and_auto_resume,
    "torchrun restart after SIGKILL": torchrun_restart,
    "SIGTERM preemption": preemption,
    "kill during a save": kill_during_save,
    "frozen peer": frozen_peer,
}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--collective_timeout", type=float, default=10, help="seconds, for the frozen-peer case")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, case) in enumerate(CASES.items()):
            figures = case(Path(tmp) / f"case_{i}", args.collective_timeout)
            rows.append({"case": name, **{k: None if v is None else round(v, 1) for k, v in figures.items()}})
            print(f"{name}: {rows[-1]}", flush=True)
    print("\n| case | steps lost | failure to job ended (s) | failure to training again (s) |\n|---|---|---|---|")
    for r in rows:
        detect = "-" if r["detect_s"] is None else r["detect_s"]
        print(f"| {r['case']} | {r['steps_lost']} | {detect} | {r['to_training_s']} |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    settings = {"checkpoint_every": EVERY, "failure_at_step": STRIKE, "collective_timeout": args.collective_timeout}
    (RESULTS / "recovery.json").write_text(json.dumps({**settings, "cases": rows}, indent=1) + "\n")
    print(f"wrote {RESULTS / 'recovery.json'}")


if __name__ == "__main__":
    main()
