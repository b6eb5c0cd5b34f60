"""slurm/train.sbatch on one machine: 2 "nodes" x 2 CPU processes, against one process.

There is no SLURM here, so the test puts three small stand-ins on PATH, each doing what the real
command does for this script:
- `srun` runs its command once per node (SLURM_NNODES times), each task with its own
  SLURM_NODEID / SLURM_PROCID / SLURM_LOCALID, and records the task pids;
- `scancel --signal=TERM` sends SIGTERM to every process of those tasks (the launchers and their
  workers), as SLURM does to a job step;
- `scontrol` records its call; `scontrol show hostnames` fails, so launch_node.sh takes the first
  host from SLURM_JOB_NODELIST itself (its fallback where scontrol is missing, e.g. in containers).
The batch script itself runs with SLURM_NODEID=0, as on the first node of a real job: had it
expanded the per-node variables, both nodes would be machine rank 0 and the run could not form.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import (
    REPO,
    TINY,
    assert_same_losses,
    free_port,
    job_env,
    kill_tree,
    read_metrics,
    run_cmd,
)

# one xdist worker runs these tests: its module fixture launches the SLURM job that its tests check
pytestmark = pytest.mark.xdist_group("slurm")

SBATCH = REPO / "slurm" / "train.sbatch"
LAUNCH_NODE = REPO / "slurm" / "launch_node.sh"
JOB_ID = "4242"
STEPS = 20
# test_fsdp.py's flags, so that the one-process reference (train_ddp.py, global batch 16) is shared
FLAGS = ["--max_steps", str(STEPS), "--eval_every", "10", "--eval_batch_size", "64"]

FAKE_SRUN = """#!/bin/bash
while [[ $1 == --* ]]; do shift; done  # srun's own options
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
    SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 "$@" &
    pids+=($!)
    echo $! >>"$FAKE_SLURM_DIR/tasks"
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""
FAKE_SCANCEL = """#!/bin/bash
echo "scancel $*" >>"$FAKE_SLURM_DIR/calls"
for task in $(cat "$FAKE_SLURM_DIR/tasks"); do
    kill -TERM $task $(ps -o pid= --ppid $task) 2>/dev/null || true
done
"""
FAKE_SCONTROL = """#!/bin/bash
echo "scontrol $*" >>"$FAKE_SLURM_DIR/calls"
[[ $1 == requeue ]]
"""


def slurm_env(fake_dir, **extra) -> dict:
    """What SLURM sets in a batch script on the first node of a 2-node job, plus the test's choices."""
    env = {
        "PATH": f"{fake_dir}{os.pathsep}{os.environ['PATH']}",
        "FAKE_SLURM_DIR": str(fake_dir),
        "SLURM_JOB_ID": JOB_ID,
        "SLURM_JOB_NAME": "test-slurm",
        "SLURM_SUBMIT_DIR": str(REPO),
        "SLURM_NNODES": "2",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_NODELIST": "localhost,127.0.0.2",
        "SLURM_NODEID": "0",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "GPUS_PER_NODE": "2",
        "LAUNCH_CPU": "1",
        "MIXED_PRECISION": "no",
        "MASTER_PORT": str(free_port()),
        "PYTHON": sys.executable,
    }
    return job_env(**{**env, **extra})


def calls(fake_dir) -> list[str]:
    """The scancel and scontrol calls that act on the job (not launch_node.sh's `scontrol show`)."""
    path = fake_dir / "calls"
    lines = path.read_text().splitlines() if path.exists() else []
    return [line for line in lines if not line.startswith("scontrol show")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache, reference):
    """The SLURM job twice into one output folder: stopped by the time-limit warning (USR1 to the
    batch script) after step 3, then requeued to the end. Global batch 16: 2 nodes x 2 x 4."""
    root = tmp_path_factory.mktemp("slurm")

    fake = root / "bin"
    fake.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scancel", FAKE_SCANCEL), ("scontrol", FAKE_SCONTROL)):
        (fake / name).write_text(text)
        (fake / name).chmod(0o755)
    out = root / "job"
    cmd = ["bash", str(SBATCH), *TINY, *FLAGS, "--batch_size", "4", "--data_cache_dir", data_cache]
    env = slurm_env(fake, OUTPUT_DIR=str(out))

    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 240
        while not ((out / "metrics.jsonl").exists() and sum(r["type"] == "train" for r in read_metrics(out)) >= 3):
            assert time.monotonic() < deadline and proc.poll() is None, "the job ended before the time-limit warning"
            time.sleep(0.05)
        proc.send_signal(signal.SIGUSR1)  # SLURM's --signal=B:USR1@120
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        kill_tree(proc.pid)
    first = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    calls_after_first = calls(fake)

    (fake / "tasks").unlink()
    second = run_cmd(cmd, env=slurm_env(fake, OUTPUT_DIR=str(out), SLURM_RESTART_COUNT="1"))
    return {
        "reference": reference(*FLAGS, "--batch_size", "16"),
        "out": out,
        "first": first,
        "second": second,
        "calls_after_first": calls_after_first,
        "calls": calls(fake),
    }


def test_scripts_parse():
    for path in (SBATCH, LAUNCH_NODE):
        result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr


def test_batch_script_leaves_per_node_variables_to_the_nodes():
    """The quoting trap: SLURM_NODEID (or PROCID, LOCALID) expanded in the batch script is the first
    node's, on every node. Only launch_node.sh, run by srun on each node, may read them."""
    code = [line for line in SBATCH.read_text().splitlines() if not line.lstrip().startswith("#")]
    assert not [line for line in code if any(v in line for v in ("SLURM_NODEID", "SLURM_PROCID", "SLURM_LOCALID"))]
    assert "SLURM_NODEID" in LAUNCH_NODE.read_text()


@pytest.mark.parametrize(
    "nodelist, first",
    [("gpu-a[007-009,012],gpu-b1", "gpu-a007"), ("node1,node2", "node1"), ("n[1-2]-ib,x[3]", "n1-ib")],
)
def test_launch_line_per_node(nodelist, first, tmp_path):
    """The command each node runs: its own machine rank, the first host as rendezvous, 16 processes."""
    for rank in ("0", "1"):
        env = slurm_env(tmp_path, SLURM_NODEID=rank, SLURM_JOB_NODELIST=nodelist, GPUS_PER_NODE="8")
        env["LAUNCH_DRY_RUN"], env["PATH"] = "1", os.environ["PATH"]  # the real PATH: no scontrol
        result = run_cmd(["bash", str(LAUNCH_NODE), "scripts/train_fsdp.py", "--seed", "a b"], env=env)
        assert result.returncode == 0, result.stderr
        for expected in (f"--machine_rank {rank} ", "--num_processes 16 ", f"--main_process_ip {first} "):
            assert expected in result.stdout, result.stdout
        assert result.stdout.rstrip().endswith(r"scripts/train_fsdp.py --seed a\ b --cpu"), result.stdout


def test_two_nodes_form_one_group_of_4_ranks(runs):
    first = runs["first"]
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "launch_node: node 0 of 2" in first.stdout and "launch_node: node 1 of 2" in first.stdout
    # each node's first process prints the header, and both see one group of 4
    assert first.stdout.count("train_fsdp: 4 process(es)") == 2, first.stdout[-3000:]
    # one global rank 0 writes the metrics: one record per step (every node rank 0 would not even start)
    steps = [r["step"] for r in read_metrics(runs["out"]) if r["type"] == "train"]
    assert steps == list(range(1, len(steps) + 1)), steps
    assert {r["world_size"] for r in read_metrics(runs["out"]) if r["type"] == "train"} == {4}


def test_time_limit_checkpoints_requeues_and_resumes(runs):
    first, second, out = runs["first"], runs["second"], runs["out"]
    stopped = next(r["final_step"] for r in read_metrics(out) if r["type"] == "summary")
    assert 3 <= stopped < STEPS
    assert f"preempted at step {stopped}: resume with --resume_from_checkpoint auto" in first.stdout
    assert runs["calls_after_first"] == [f"scancel --signal=TERM {JOB_ID}", f"scontrol requeue {JOB_ID}"]
    # the launchers ignored SIGTERM and ended with their workers, instead of killing them
    assert "SignalException" not in first.stderr, first.stderr[-3000:]

    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "--resume_from_checkpoint auto: resuming from" in second.stdout
    assert runs["calls"] == runs["calls_after_first"], "a finished job must not be requeued"
    assert (out / "model" / "model.safetensors").is_file()


def test_matches_one_process_step_for_step(runs):
    """Every step, before the stop and after the requeue, within 1e-5 of one process (train_ddp.py)."""
    job = {r["step"]: r["loss"] for r in read_metrics(runs["out"]) if r["type"] == "train"}
    reference = {r["step"]: r["loss"] for r in read_metrics(runs["reference"]) if r["type"] == "train"}
    assert sorted(job) == list(range(1, STEPS + 1))
    assert_same_losses(reference, job, list(range(1, STEPS + 1)), tol=1e-5)
