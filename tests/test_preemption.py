"""Preemption: SIGTERM to the workers (what SLURM and Kubernetes send before they kill a job).
Every rank finishes its step, they agree on the step to stop at, write a checkpoint, print how to
resume, and the job exits 0; `--resume_from_checkpoint auto` then gives the uninterrupted run."""

import signal
import subprocess
import time

import psutil
import pytest

from conftest import (
    FAULT_RUN,
    REPO,
    TINY,
    assert_same_losses,
    job_env,
    kill_tree,
    launch,
    launch_cmd,
    read_metrics,
    train_losses,
)

# one xdist worker runs these tests: shares its uninterrupted runs with test_restart.py (shared_run)
pytestmark = pytest.mark.xdist_group("faults")

FLAGS = [*TINY, *FAULT_RUN]
STEPS = 24


def start_and_preempt(script: str, args: list[str], out, after_step: int = 3) -> subprocess.CompletedProcess:
    """Launch on 2 processes; once `after_step` is logged, SIGTERM the workers (not the launcher)."""
    proc = subprocess.Popen(
        launch_cmd(script, [*args, "--output_dir", str(out)], nproc=2),
        cwd=REPO,
        env=job_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            metrics = out / "metrics.jsonl"
            if metrics.exists() and sum(r["type"] == "train" for r in read_metrics(out)) >= after_step:
                break
            assert proc.poll() is None, "the run ended before it could be preempted"
            time.sleep(0.05)
        workers = [p for p in psutil.Process(proc.pid).children(recursive=True) if script in " ".join(p.cmdline())]
        assert len(workers) == 2, workers
        for worker in workers:
            worker.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        kill_tree(proc.pid)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.mark.parametrize("script", ["train_ddp.py", "train_fsdp.py"])
def test_sigterm_checkpoints_exits_0_and_resumes_exactly(script, tmp_path, data_cache, shared_run):
    args = [*FLAGS, "--data_cache_dir", data_cache]
    straight, out = shared_run(script, 2, *FAULT_RUN), tmp_path / "preempted"

    result = start_and_preempt(script, args, out)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    stopped = max(train_losses(out))
    assert 3 <= stopped < STEPS
    assert f"preempted at step {stopped}: resume with --resume_from_checkpoint auto" in result.stdout
    assert (out / "checkpoints" / f"step_{stopped}").is_dir() and not (out / "model").exists()
    assert read_metrics(out)[-1] == {
        **read_metrics(out)[-1],
        "type": "summary",
        "preempted": True,
        "final_step": stopped,
    }

    launch(script, [*args, "--output_dir", str(out), "--resume_from_checkpoint", "auto"], nproc=2)
    assert sorted(train_losses(out)) == list(range(1, STEPS + 1))
    assert_same_losses(train_losses(straight), train_losses(out), list(range(1, STEPS + 1)), tol=1e-5)
    assert (out / "model" / "model.safetensors").is_file()
