"""Restarts under torchrun: one rank killed mid-run (SIGKILL: no chance to save), torchrun
restarts the workers, `--resume_from_checkpoint auto` continues from the newest complete
checkpoint, and the run ends as the uninterrupted one would."""

import signal
import subprocess
import sys
import time

import psutil
import pytest

from conftest import FAULT_RUN, REPO, SCRIPTS, TINY, free_port, job_env, kill_tree, read_metrics, train_losses

# one xdist worker runs these tests: shares its uninterrupted runs with test_preemption.py (shared_run)
pytestmark = pytest.mark.xdist_group("faults")

STEPS = 24
FLAGS = [
    *TINY,
    *FAULT_RUN,
    "--checkpoint_every",
    "5",
    "--resume_from_checkpoint",
    "auto",
]


@pytest.mark.parametrize("script", ["train_ddp.py", "train_fsdp.py"])
def test_torchrun_restart_resumes_from_the_newest_checkpoint(script, tmp_path, data_cache, shared_run):
    args = [*FLAGS, "--data_cache_dir", data_cache]
    straight, out = shared_run(script, 2, *FAULT_RUN), tmp_path / "restarted"

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--max_restarts",
        "2",
        "--master_port",
        str(free_port()),
        str(SCRIPTS / script),
        *args,
        "--output_dir",
        str(out),
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:  # past the first checkpoint (step 4)
            if (out / "metrics.jsonl").exists() and max(train_losses(out), default=0) >= 6:
                break
            assert proc.poll() is None, "the run ended before a rank could be killed"
            time.sleep(0.05)
        workers = [p for p in psutil.Process(proc.pid).children(recursive=True) if script in " ".join(p.cmdline())]
        assert len(workers) == 2, workers
        workers[-1].send_signal(signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 0, stderr[-3000:]
    assert "--resume_from_checkpoint auto: resuming from" in stdout

    records = read_metrics(out)
    train = [r for r in records if r["type"] == "train"]
    expected = train_losses(straight)
    assert {r["step"] for r in train} == set(range(1, STEPS + 1)), "no step may be missing"
    worst = max(abs(r["loss"] - expected[r["step"]]) for r in train)  # re-run steps too
    assert worst <= 1e-5, worst
    resumed = [r for r in train if r.get("resumed")]
    assert resumed and all(r["step"] > 4 for r in resumed)  # the first record after the restart says so
    assert [r["final_step"] for r in records if r["type"] == "summary"] == [STEPS]  # one finished run, one export
    assert (out / "model" / "model.safetensors").is_file()
