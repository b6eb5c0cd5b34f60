"""BatchNorm on every layout (issue 29), done as docs/your-model-reference.md's worked example: a CNN
with BatchNorm on the 8x8 digits (data/digits.csv.gz), copied from train_ddp.py, train_fsdp.py and
train_localsgd.py with the page's own digits.py and diffs.

- --sync_batchnorm: 2 and 4 processes match one process within 1e-5 per step (DDP, FSDP, Local SGD
  with K = 1 and plain SGD), fp32, at the same global batch and micro-batch;
- without it, a 2-process run differs from one process (the start line says so and names the flag),
  and yet its in-run evaluation equals scripts/evaluate.py on its exported model within 1e-6, for
  each script (DDP keeps rank 0's statistics; FSDP, Local SGD and DiLoCo average them);
- the Task contract is checked before step 1: each mistake of the issue is one `error:` line."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_your_model import code_blocks, run_copy

from conftest import CPU_MULTI, REPO, SCRIPTS, assert_same_losses, free_port, read_metrics, run_in_turn

PAGE, PAGE_ZH = REPO / "docs" / "your-model-reference.md", REPO / "docs" / "zh" / "your-model-reference.md"
DIFF_LABEL = re.compile(r"--- digits/(\S+)\n\+\+\+ digits/(\S+)\n")
COPIES = ("train_ddp.py", "train_fsdp.py", "train_localsgd.py")
STEPS = 10  # fp32; with SGD at lr 0.05 the CNN's runs stay well within 1e-5 of each other this long (at lr 0.1 an
# AMD EPYC host drifted to 1.6e-5 by step 8: the run is chaotic there, and matmul rounding differs by CPU)
FLAGS = ["--max_steps", str(STEPS), "--warmup_steps", "2", "--log_every", "1", "--eval_every", "5"]
SGD = ["--optimizer", "sgd", "--learning_rate", "0.05", "--max_grad_norm", "0"]
GLOBAL_BATCH = 64
SYNC_GROUP = pytest.mark.xdist_group("batchnorm_sync")
PLAIN_GROUP = pytest.mark.xdist_group("batchnorm_plain")


def page_module(path: Path = PAGE) -> str:
    found = [body for body in code_blocks(path, "python") if "class DigitsTask(Task)" in body]
    assert len(found) == 1, f"{path.name}: expected one ```python block with class DigitsTask, found {len(found)}"
    return found[0]


def page_diffs(path: Path = PAGE) -> dict[str, str]:
    """{script: diff} of the page's ```diff blocks labelled `--- digits/<script>`."""
    diffs = {}
    for body in code_blocks(path, "diff"):
        label = DIFF_LABEL.match(body)
        if label:
            assert label.group(1) == label.group(2), body[:200]
            diffs[label.group(1)] = body
    return diffs


@pytest.fixture(scope="module")
def copy(tmp_path_factory) -> Path:
    """What the page tells a user: the three scripts and common/ in one folder outside the repository,
    digits.py and data/digits.csv.gz beside them, the page's diffs applied with `patch -p1`."""
    folder = tmp_path_factory.mktemp("digits") / "digits"
    folder.mkdir()
    shutil.copytree(SCRIPTS / "common", folder / "common", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "data" / "digits.csv.gz", folder)
    (folder / "digits.py").write_text(page_module())
    diffs = page_diffs()
    assert set(diffs) == set(COPIES), f"the page should show one digits/ diff per script: {sorted(diffs)}"
    for script in COPIES:
        shutil.copy(SCRIPTS / script, folder / script)
        result = subprocess.run(
            ["patch", "-p1", "--fuzz=0", "--no-backup-if-mismatch"],
            cwd=folder,
            input=diffs[script],
            capture_output=True,
            text=True,
        )
        assert result.returncode == 0, (
            f"the page's digits/{script} diff no longer applies (python tests/your_model/update_page.py rewrites "
            f"it):\n{result.stdout}{result.stderr}"
        )
    return folder


def train(folder: Path, script: str, nproc: int, out: str, *extra: str) -> tuple[Path, str]:
    """One run of a copy: `python` for 1 process, `accelerate launch` with cpu_multi.yaml for more, the
    same global batch of 64. Returns the run's folder and its stdout (the start lines)."""
    args = [script, *FLAGS, "--batch_size", str(GLOBAL_BATCH // nproc), "--output_dir", out, *extra]
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_MULTI)]
    ports = ["--num_processes", str(nproc), "--main_process_port", str(free_port())]
    cmd = [sys.executable, *args] if nproc == 1 else [*launcher, *ports, *args]
    result = run_copy(folder, cmd)
    assert result.returncode == 0, f"exit {result.returncode}: {' '.join(cmd)}\n{result.stderr[-5000:]}"
    return folder / out, result.stdout


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run) if r["type"] == "train"}


def max_gap(a: dict, b: dict) -> float:
    return max(abs(a[s] - b[s]) for s in a)


# ----------------------------------------------------------------------------- the page
def test_the_page_shows_the_example_in_both_editions():
    assert set(page_diffs()) == set(COPIES)
    assert page_diffs(PAGE_ZH) == page_diffs() and page_module(PAGE_ZH) == page_module()
    assert "nn.BatchNorm2d" in page_module() and 'units_path = ["conv1", "conv2"]' in page_module()


# ----------------------------------------------------------------------------- --sync_batchnorm
@pytest.fixture(scope="module")
def one_process(copy) -> dict[str, Path]:
    """The references: one process, AdamW (DDP, FSDP) and plain SGD (Local SGD with K = 1)."""
    return {
        "adamw": train(copy, "train_ddp.py", 1, "runs/one_adamw")[0],
        "sgd": train(copy, "train_ddp.py", 1, "runs/one_sgd", *SGD)[0],
    }


def train_in_turn(folder: Path, runs: list[tuple]) -> list[tuple[Path, str]]:
    """Several runs of a copy [(script, nproc, out, *extra), ...], those of one process count in one launch, in
    turn (run_in_turn), each with the global batch of 64 -> [(its folder, its stdout), ...] in that order."""
    done = {}
    for nproc in sorted({run[1] for run in runs}):
        mine = [run for run in runs if run[1] == nproc]
        cases = [
            [str(folder / script), [*FLAGS, "--batch_size", str(GLOBAL_BATCH // nproc), "--output_dir", out, *extra]]
            for script, _, out, *extra in mine
        ]
        for run, result in zip(mine, run_in_turn(cases, nproc, folder / f"in_turn_{nproc}", cwd=folder), strict=True):
            assert result["returncode"] == 0, f"exit {result['returncode']}: {run}\n{result['stderr']}"
            done[run] = (folder / run[2], result["stdout"])
    return [done[run] for run in runs]


def sync_run(script: str, nproc: int) -> tuple:
    extra = [*SGD, "--sync_every", "1"] if script == "train_localsgd.py" else []
    return (script, nproc, f"runs/sync_{script[6:-3]}_{nproc}", "--sync_batchnorm", *extra)


@pytest.fixture(scope="module")
def sync_runs(copy) -> dict:
    """The six --sync_batchnorm runs (three copies on 2 and 4 processes) in two launches."""
    runs = [sync_run(script, nproc) for nproc in (2, 4) for script in COPIES]
    return dict(zip(runs, train_in_turn(copy, runs), strict=True))


@SYNC_GROUP
@pytest.mark.parametrize("nproc", [2, 4])
@pytest.mark.parametrize("script", COPIES)
def test_sync_batchnorm_matches_one_process(sync_runs, one_process, script, nproc):
    run, stdout = sync_runs[sync_run(script, nproc)]
    assert "--sync_batchnorm: 2 BatchNorm layer(s) normalise over the global micro-batch" in stdout, stdout
    reference = losses(one_process["sgd" if script == "train_localsgd.py" else "adamw"])
    assert_same_losses(reference, losses(run), range(1, STEPS + 1), tol=1e-5)
    gap = max_gap(reference, losses(run))
    print(f"{script} on {nproc} processes with --sync_batchnorm: max |loss - one process| {gap:.1e}")


# ----------------------------------------------------------------------------- without the flag
PLAIN = {  # what runs on 2 processes without --sync_batchnorm: the three copies, and DiLoCo
    "ddp": ("train_ddp.py", []),
    "fsdp": ("train_fsdp.py", []),
    "localsgd": ("train_localsgd.py", ["--sync_every", "4", "--save_rank_models"]),
    "diloco": ("train_localsgd.py", ["--sync_every", "4", "--outer_optimizer", "nesterov"]),
}


def plain_run(name: str) -> tuple:
    script, extra = PLAIN[name]
    return (script, 2, f"runs/plain_{name}", "--checkpoint_every", "5", *extra)


@pytest.fixture(scope="module")
def plain_runs(copy) -> dict:
    """The four runs without the flag, on 2 processes, in one launch."""
    runs = [plain_run(name) for name in sorted(PLAIN)]
    return dict(zip(sorted(PLAIN), train_in_turn(copy, runs), strict=True))


@PLAIN_GROUP
@pytest.mark.parametrize("name", sorted(PLAIN))
def test_in_run_evaluation_is_that_of_the_exported_model(copy, one_process, plain_runs, name):
    """One set of running statistics: the last in-run evaluation (the fused model, for Local SGD and
    DiLoCo) equals scripts/evaluate.py on OUTPUT_DIR/model, which records its Task (model/task.json);
    for Local SGD also on the rank models merged by merge_checkpoints.py (their average: the fused model)."""
    script, _ = PLAIN[name]
    run, stdout = plain_runs[name]
    assert "--sync_batchnorm normalises over all 2 ranks" in stdout and "differs from one process" in stdout, stdout
    in_run = [r for r in read_metrics(run) if r["type"] == "eval"][-1]
    assert in_run["step"] == STEPS and in_run["num_samples"] == 360
    result = run_copy(copy, [sys.executable, str(SCRIPTS / "evaluate.py"), "--model_dir", str(run / "model")])
    assert result.returncode == 0, result.stderr[-3000:]
    exported = json.loads(result.stdout.strip().splitlines()[-1])
    assert exported["num_samples"] == 360
    assert exported["eval_loss"] == pytest.approx(in_run["eval_loss"], abs=1e-6), (exported, in_run)
    assert exported["accuracy"] == pytest.approx(in_run["accuracy"], abs=1e-9)
    if name == "localsgd":  # the replicas as trained, merged after training: the fused model, found by task.json
        merged = run / "merged"
        ranks = [str(run / "rank_models" / f"rank_{r}") for r in range(2)]
        result = run_copy(copy, [sys.executable, str(SCRIPTS / "merge_checkpoints.py"), *ranks, "--out", str(merged)])
        assert result.returncode == 0, result.stderr[-3000:]
        result = run_copy(copy, [sys.executable, str(SCRIPTS / "evaluate.py"), "--model_dir", str(merged)])
        assert result.returncode == 0, result.stderr[-3000:]
        assert json.loads(result.stdout.strip().splitlines()[-1])["eval_loss"] == pytest.approx(
            in_run["eval_loss"], abs=1e-6
        )
    if name in ("ddp", "fsdp"):  # the layouts disagree without the flag (Local SGD's replicas differ anyway)
        gap = max_gap(losses(one_process["adamw"]), losses(run))
        print(f"{script} on 2 processes without --sync_batchnorm: max |loss - one process| {gap:.1e}")
        assert gap > 1e-5, "BatchNorm over each rank's half of the batch should not match one process"


# ----------------------------------------------------------------------------- the contract, at start
COUNT_TARGETS = "    def count_targets(self, batch):\n        return batch[1].numel()  # one target per image, counted"
BROKEN = {  # (what is replaced in digits.py, by what, the start of its one error line)
    "inputs": (
        "        return (batch[0],)  # a tuple: model(x)",
        "        return batch[0]",
        "error: Task.inputs returned a Tensor of shape (4, 1, 8, 8); expected a tuple",
    ),
    "count_targets": (
        COUNT_TARGETS,
        "    def _unused(self, batch):\n        return 0  #",
        "error: Task.count_targets is not implemented",
    ),
    "eval_metrics": (
        'return {"eval_loss": sums["loss"] / sums["targets"], ',
        'return {"loss": sums["loss"] / sums["targets"], ',
        "error: Task.eval_metrics returned a dict with keys ['accuracy', 'loss']; expected a dict of the reported",
    ),
}


@pytest.mark.parametrize("mistake", sorted(BROKEN))
def test_a_broken_contract_is_one_line_before_step_1(copy, tmp_path, mistake):
    old, new, expected = BROKEN[mistake]
    folder = tmp_path / "broken"
    shutil.copytree(copy, folder, ignore=shutil.ignore_patterns("runs", "__pycache__"))
    module = (folder / "digits.py").read_text()
    assert old in module, f"the page's digits.py no longer holds {old!r}"
    (folder / "digits.py").write_text(module.replace(old, new))
    result = run_copy(folder, [sys.executable, "train_ddp.py", *FLAGS, "--output_dir", "runs/broken"])
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1, f"exit {result.returncode}\n{result.stderr[-3000:]}"
    assert errors[0].startswith(expected), errors[0]
    assert "Traceback" not in result.stderr and not (folder / "runs" / "broken" / "metrics.jsonl").exists()
    shown = PAGE.read_text(encoding="utf-8")
    assert errors[0] in shown, f"docs/your-model-reference.md should show the line: {errors[0]}"
