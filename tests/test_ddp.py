"""train_ddp.py against the single-process reference: real multi-process CPU launches (gloo)."""

import json
import re
import shutil
import subprocess
import time

import psutil
import pytest

from conftest import (
    REPO,
    SCRIPTS,
    TINY,
    accelerate_launch_cmd,
    assert_same_losses,
    free_port,
    job_env,
    kill_tree,
    launch,
    launch_tiny,
    read_metrics,
    run_cmd,
    run_in_turn,
    train_losses,
)

# one xdist worker runs these tests: its module fixture launches the runs that most of its tests compare
pytestmark = pytest.mark.xdist_group("ddp")

FLAGS = ["--max_steps", "20", "--eval_every", "10", "--eval_batch_size", "64"]
STEPS = list(range(1, 21))


def start_two_machines(args: list[str], **streams) -> list[subprocess.Popen]:
    """train_ddp.py as machine ranks 0 and 1 of a --num_machines 2 launch on loopback, one process each;
    `streams` are Popen's stdout/stderr."""
    port, procs = free_port(), []
    for rank in (0, 1):
        flags = ["--multi_gpu", "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(rank)]
        flags += ["--main_process_ip", "127.0.0.1", "--main_process_port", str(port), "--rdzv_backend", "static"]
        cmd = accelerate_launch_cmd(flags, "train_ddp.py", args)
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=job_env(), text=True, start_new_session=True, **streams))
    return procs


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    """Global batch 16 for 20 steps on 3-digit addition, three ways. Answers have 2 to 5 target
    tokens, so ranks and micro-batches hold unequal target counts (docs/troubleshooting.md, "Loss
    normalised per micro-batch")."""
    root = tmp_path_factory.mktemp("ddp")
    out = {name: root / name for name in ("one", "two", "two_accum")}
    launch_tiny("train_ddp.py", out["one"], data_cache, *FLAGS, "--batch_size", "16", nproc=1)
    accum = ["--batch_size", "4", "--gradient_accumulation_steps", "2"]
    both = [("two", ["--batch_size", "8"]), ("two_accum", accum)]  # one 2-process launch, in turn
    cases = [
        [str(SCRIPTS / "train_ddp.py"), [*TINY, *FLAGS, *flags, "--data_cache_dir", data_cache, "--output_dir"]]
        for _, flags in both
    ]
    for case, (name, _) in zip(cases, both, strict=True):
        case[1].append(str(out[name]))
    for (name, _), result in zip(both, run_in_turn(cases, 2, root / "in_turn"), strict=True):
        assert result["returncode"] == 0, f"{name}: exit {result['returncode']}\n{result['stderr']}"
    return out


def test_two_processes_match_one(runs):
    one, two = read_metrics(runs["one"]), read_metrics(runs["two"])
    assert {r["world_size"] for r in two if r["type"] == "train"} == {2}, "the launch did not start 2 ranks"
    assert {r["global_batch_size"] for r in one + two if r["type"] == "train"} == {16}
    assert_same_losses(train_losses(runs["one"]), train_losses(runs["two"]), STEPS, tol=1e-5)
    losses = train_losses(runs["one"])
    assert losses[20] < losses[1] - 0.3, "the model did not learn"


def test_gradient_accumulation_matches_whole_batch(runs):
    assert_same_losses(train_losses(runs["one"]), train_losses(runs["two_accum"]), STEPS, tol=1e-5)


def test_in_run_eval_is_layout_free(runs):
    evals = {name: [r for r in read_metrics(path) if r["type"] == "eval"] for name, path in runs.items()}
    for name in ("two", "two_accum"):
        for a, b in zip(evals["one"], evals[name], strict=True):
            assert a["num_samples"] == b["num_samples"] == 1000
            assert abs(a["eval_loss"] - b["eval_loss"]) < 1e-5 and a["exact_match"] == b["exact_match"]


@pytest.mark.parametrize("nproc", [1, 2, 3])
def test_evaluate_counts_each_sample_once(runs, nproc, tmp_path):
    """1000 validation samples, batch 64: neither 2 x 64 nor 3 processes divide it."""
    final = [r for r in read_metrics(runs["two"]) if r["type"] == "eval"][-1]
    out = tmp_path / "eval.json"
    launch(
        "evaluate.py",
        ["--model_dir", str(runs["two"] / "model"), "--batch_size", "64", "--output_file", str(out)],
        nproc=nproc,
    )
    result = json.loads(out.read_text())
    assert result["num_samples"] == 1000
    assert abs(result["eval_loss"] - final["eval_loss"]) < 1e-5
    assert result["exact_match"] == final["exact_match"]


def test_resume_is_exact(tmp_path, data_cache):
    """20 steps straight vs 10, stop, resume, 10 more: on 2 processes, 1-digit addition (90 train
    samples, global batch 12: 7 steps an epoch), so the stop falls mid-epoch and the run crosses
    epochs. Warm-up ends at step 5, so the LR schedule matters too."""
    args = [
        *TINY,
        "--max_steps",
        "20",
        "--addition_digits",
        "1",
        "--batch_size",
        "6",
        "--data_cache_dir",
        data_cache,
        "--checkpoint_every",
        "5",
        "--keep_last",
        "2",
    ]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    launch("train_ddp.py", [*args, "--output_dir", str(straight)], nproc=2)
    launch("train_ddp.py", [*args, "--output_dir", str(resumed), "--stop_at_step", "10"], nproc=2)
    assert not (resumed / "model").exists(), "a stopped run must not export a final model"
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir()) == ["step_10", "step_5"]
    (resumed / "checkpoints" / ".tmp_step_15").mkdir()  # what an interrupted save leaves: never 'latest'
    launch("train_ddp.py", [*args, "--output_dir", str(resumed), "--resume_from_checkpoint", "latest"], nproc=2)
    a, b = train_losses(straight), train_losses(resumed)
    assert sorted(b) == STEPS, "the resumed run must append steps 11-20 to the same metrics.jsonl"
    assert_same_losses(a, b, list(range(11, 21)), tol=1e-6)
    assert max(r["epoch"] for r in read_metrics(straight) if r["type"] == "train") >= 2
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir() if not p.name.startswith(".")) == [
        "step_15",
        "step_20",
    ]
    assert (resumed / "model" / "model.safetensors").is_file()


def test_two_machines_on_loopback_match_one_machine(runs, tmp_path, data_cache):
    """--num_machines 2, machine ranks 0 and 1, one process each, against 2 processes on one machine."""
    out = tmp_path / "two_machines"
    args = [*TINY, *FLAGS, "--batch_size", "8", "--data_cache_dir", data_cache, "--output_dir", str(out)]
    procs = start_two_machines(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        logs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            kill_tree(p.pid)
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    assert {r["world_size"] for r in read_metrics(out) if r["type"] == "train"} == {2}
    assert_same_losses(train_losses(runs["two"]), train_losses(out), STEPS, tol=1e-5)


def test_launch_that_starts_one_process_is_refused(tmp_path):
    """`accelerate launch --cpu --num_processes 2` starts ONE process: say so, don't train
    (docs/troubleshooting.md, "Only one process started")."""
    out = tmp_path / "run"
    cmd = accelerate_launch_cmd(
        ["--cpu", "--num_processes", "2", "--num_machines", "1"],
        "train_ddp.py",
        ["--model_size", "tiny", "--output_dir", str(out)],
    )
    result = run_cmd(cmd)
    assert result.returncode != 0
    assert "error: accelerate launch was asked for several processes but started only one" in result.stderr
    assert not out.exists()


def test_multi_gpu_launch_without_cuda_joins_one_group(tmp_path, data_cache):
    """A torchrun-style launch on a CPU-only machine must give 2 ranks of ONE run, not 2 runs
    (docs/troubleshooting.md, "Several processes that each think they are alone")."""
    out = tmp_path / "run"
    cmd = accelerate_launch_cmd(
        ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--main_process_port", str(free_port())],
        "train_ddp.py",
        [*TINY, "--max_steps", "2", "--data_cache_dir", data_cache, "--output_dir", str(out)],
    )
    result = run_cmd(cmd)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 process(es)" in result.stdout and result.stdout.count("train_ddp: ") == 1
    assert {r["world_size"] for r in read_metrics(out) if r["type"] == "train"} == {2}


def test_frozen_peer_ends_the_run_after_the_collective_timeout(tmp_path, data_cache):
    """Two machines on loopback; machine 1 freezes mid-run (SIGSTOP: its connections stay open,
    nothing answers). Machine 0 must fail once --collective_timeout (12 s) has passed, not wait forever,
    with one line that names the step and the collective it waited in."""
    out = tmp_path / "run"
    args = [
        *TINY,
        "--max_steps",
        "100000",
        "--log_every",
        "5",
        "--data_cache_dir",
        data_cache,
        "--collective_timeout",
        "12",
        "--output_dir",
        str(out),
    ]
    procs = start_two_machines(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not ((out / "metrics.jsonl").exists() and '"train"' in (out / "metrics.jsonl").read_text()):
            assert time.monotonic() < deadline and procs[0].poll() is None, "training never started"
            time.sleep(0.5)
        for worker in psutil.Process(procs[1].pid).children(recursive=True):
            worker.suspend()
        start = time.monotonic()
        _, err = procs[0].communicate(timeout=120)
        assert procs[0].returncode != 0, "machine 0 finished a run whose peer was dead"
        waited = time.monotonic() - start
        assert 9 < waited < 80, f"machine 0 gave up after {waited:.0f} s, not after the 12 s timeout"
        # e.g. "error: step 7: all_reduce (gradient sync in backward) at train_ddp.py:111 waited 12 s for a peer ..."
        line = re.search(r"error: step (\d+): (all_reduce\b[^\n]*) waited 12 s for a peer that did not answer", err)
        assert line, err[-3000:]
        assert int(line.group(1)) >= max(train_losses(out)), "the step named is not the one the run was at"
        assert 'docs/troubleshooting.md, "A peer did not answer, or was lost"' in err
        assert "[rank0]: Traceback" not in err, "the one line replaces the worker's traceback"
    finally:
        for p in procs:
            kill_tree(p.pid)


def test_a_buffer_with_unusual_strides_trains_under_ddp(tmp_path, data_cache):
    """pytorch/examples' TransformerModel keeps its positional table as zeros(L, 1, d).transpose(0, 1): strides
    DDP's coalesced buffer broadcast refuses (it was a one-line refusal blaming the model's forward). The DDP
    lesson lays such buffers out row-major first (the same values): 2 processes = 1 within 1e-5."""
    copy = tmp_path / "scripts"
    shutil.copytree(SCRIPTS / "common", copy / "common")
    text = (SCRIPTS / "train_ddp.py").read_text()
    line = "    model, task = language_model(args, data)\n"
    assert text.count(line) == 1
    odd = line + '    model.register_buffer("table", torch.zeros(8, 1, 4).transpose(0, 1))  # unusual strides\n'
    (copy / "train_ddp.py").write_text(text.replace(line, odd))
    runs = {}
    for nproc, batch in ((1, "16"), (2, "8")):
        runs[nproc] = tmp_path / f"run{nproc}"
        flags = [*TINY, "--max_steps", "3", "--batch_size", batch, "--data_cache_dir", data_cache]
        launch(str(copy / "train_ddp.py"), [*flags, "--output_dir", str(runs[nproc])], nproc=nproc)
    assert_same_losses(train_losses(runs[1]), train_losses(runs[2]), range(1, 4), 1e-5)
