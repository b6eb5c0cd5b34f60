"""docs/your-model.md: copying a script to train a model of your own is a documented, tested act.

The page's worked example is done here as a user would do it, from the page itself: its regression.py
(the ```python block holding `class RegressionTask`) and its diffs (```diff blocks headed
`--- train_fsdp.py` / `+++ train_fsdp.py`, one per script) are applied with `patch` to copies of
scripts/<script> and scripts/common/ in a folder outside the repository, and the copy runs there:
on 2 processes and on 1, fp32, 8 steps; the per-step losses must agree within 1e-5 and the runs'
metrics.jsonl must hold the example's own evaluation (eval_loss, mae, r2). The loss turned into a
mean must stop the copy at start with the page's one error line. The page's claims about the copy
are checked too: the diffs touch only the data and MODEL sections, the figures of lines changed are
the diffs', every file of common/ is listed (with its line count, within 10%), and the Chinese
edition shows the same code. tests/your_model/update_page.py rewrites the diffs and figures after the
scripts change."""

from __future__ import annotations

import difflib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CPU_MULTI, REPO, SCRIPTS, assert_same_losses, free_port, job_env, kill_tree, read_metrics

PAGE = REPO / "docs" / "your-model.md"
PAGE_ZH = REPO / "docs" / "zh" / "your-model.md"
FENCED = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)
DIFF_HEADER = re.compile(r"--- (\S+)\n\+\+\+ (\S+)\n")
SECTION = re.compile(r"^\s*# (?:-{8,}|={8,}) (\w+)")  # a script's section marker: `# ----...---- data ...`
EDITABLE = {"data", "MODEL"}
# 8 fp32 steps, a train record every step, two evaluations; --batch_size per process count below
FLAGS = ["--max_steps", "8", "--log_every", "1", "--eval_every", "4", "--warmup_steps", "2", "--eval_batch_size", "64"]
# the global batch is the same at 1 and 2 processes: FSDP splits it over the ranks, TP does not
BATCH = {"train_fsdp.py": {1: "64", 2: "32"}, "train_tp.py": {1: "64", 2: "64"}}
LOSS_LINE = 'F.mse_loss(outputs.float(), targets, reduction="sum")'
MEAN_ERROR = "error: the loss of a micro-batch is not a sum: "


def code_blocks(path: Path, language: str) -> list[str]:
    return [body for lang, body in FENCED.findall(path.read_text(encoding="utf-8")) if lang == language]


def page_diffs(path: Path = PAGE) -> dict[str, str]:
    """{script: its diff} from the page's ```diff blocks, named by their `--- x` / `+++ x` header."""
    diffs = {}
    for body in code_blocks(path, "diff"):
        header = DIFF_HEADER.match(body)
        assert header and header.group(1) == header.group(2), (
            f"a diff block without a `--- x` / `+++ x` header:\n{body}"
        )
        if "/" not in header.group(1):  # digits/<script>: the CNN example's (tests/test_batchnorm.py)
            diffs[header.group(1)] = body
    return diffs


def user_module(path: Path = PAGE) -> str:
    found = [body for body in code_blocks(path, "python") if "class RegressionTask(Task)" in body]
    assert len(found) == 1, f"{path.name}: expected one ```python block with class RegressionTask, found {len(found)}"
    return found[0]


def masked(text: str) -> str:
    """The text with its numbers as N: the loss figures of an error line vary with the machine's arithmetic."""
    return re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "N", text)


def make_copy(folder: Path, script: str) -> Path:
    """What the page tells a user to do: the script and common/ side by side, outside the repository,
    regression.py beside them, the page's diff applied with patch (no fuzz: its context lines must be
    the repository's)."""
    assert REPO not in folder.resolve().parents
    folder.mkdir(parents=True)
    shutil.copy(SCRIPTS / script, folder / script)
    shutil.copytree(SCRIPTS / "common", folder / "common", ignore=shutil.ignore_patterns("__pycache__"))
    (folder / "regression.py").write_text(user_module())
    patch = shutil.which("patch")
    assert patch, "the `patch` program is needed (apt-get install patch)"
    result = subprocess.run(
        [patch, "-p0", "--fuzz=0", "--no-backup-if-mismatch"],
        cwd=folder,
        input=page_diffs()[script],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, (
        f"the page's diff of {script} no longer applies (python tests/your_model/update_page.py rewrites it):\n"
        f"{result.stdout}{result.stderr}"
    )
    return folder


def run_copy(folder: Path, cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """Run a command in the copy's folder, in its own session; on timeout kill all it started."""
    proc = subprocess.Popen(
        cmd,
        cwd=folder,
        env=job_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s: {' '.join(cmd)}\n{out[-3000:]}\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def train(folder: Path, script: str, nproc: int, out: str) -> Path:
    """`python <script>` for 1 process, `accelerate launch` with cpu_multi.yaml for 2: the page's commands."""
    args = [script, *FLAGS, "--batch_size", BATCH[script][nproc], "--output_dir", out]
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_MULTI)]
    ports = ["--num_processes", str(nproc), "--main_process_port", str(free_port())]
    cmd = [sys.executable, *args] if nproc == 1 else [*launcher, *ports, *args]
    result = run_copy(folder, cmd)
    assert result.returncode == 0, f"exit {result.returncode}: {' '.join(cmd)}\n{result.stderr[-5000:]}"
    return folder / out


def edits_outside_sections(before: str, after: str) -> list[str]:
    """The lines of `before` that `after` removes or changes, or inserts after, outside the sections
    a user edits (from a `# ---- data` / `# ---- MODEL` / `# ==== MODEL` marker to the next marker) and
    the flags section's two lines that add the built-in data sets' and models' flags (add_builtin_flags)."""
    before_lines, section, editable = before.splitlines(), None, []
    for n, line in enumerate(before_lines):
        marker = SECTION.match(line)
        section = marker.group(1) if marker else section
        builtin_flags = "add_builtin_flags" in line or (not line.strip() and "add_builtin_flags" in before_lines[n - 1])
        editable.append(section in EDITABLE or builtin_flags)
    outside = []
    matcher = difflib.SequenceMatcher(a=before_lines, b=after.splitlines(), autojunk=False)
    for tag, i1, i2, _, _ in matcher.get_opcodes():
        touched = range(i1, i2) if tag in ("replace", "delete") else [i1 - 1] if tag == "insert" else []
        outside += [f"{n + 1}: {before_lines[n]}" for n in touched if not editable[n]]
    return outside


# ----------------------------------------------------------------------------- the page's claims
def test_the_page_shows_the_example():
    assert set(page_diffs()) == set(BATCH), f"expected one diff per script: {sorted(BATCH)}"
    assert LOSS_LINE in user_module()


@pytest.mark.parametrize("script", sorted(BATCH))
def test_the_diff_edits_only_the_data_and_model_sections(script, tmp_path):
    before = (SCRIPTS / script).read_text()
    after = (make_copy(tmp_path / "copy", script) / script).read_text()
    outside = edits_outside_sections(before, after)
    assert not outside, f"the page's {script} diff edits lines outside the data and MODEL sections:\n" + "\n".join(
        outside
    )


@pytest.mark.parametrize("script", sorted(BATCH))
def test_the_figures_of_lines_changed_are_the_diffs(script):
    lines = page_diffs()[script].splitlines()[2:]
    added = sum(line.startswith("+") for line in lines)
    removed = sum(line.startswith("-") for line in lines)
    text = PAGE.read_text(encoding="utf-8")
    row = next((line for line in text.splitlines() if line.startswith(f"| `{script}`")), "")
    assert f"+{added} −{removed}" in row, f"the page's figures row for {script} should say +{added} −{removed}: {row!r}"


def test_every_file_of_common_is_listed_with_its_length():
    listed = dict(re.findall(r"^\| `common/(\w+\.py)` \| ([\d,]+) \|", PAGE.read_text(encoding="utf-8"), re.M))
    files = {p.name: len(p.read_text(encoding="utf-8").splitlines()) for p in (SCRIPTS / "common").glob("*.py")}
    assert set(listed) == set(files), f"common/ holds {sorted(files)}, the page lists {sorted(listed)}"
    stale = {
        name: (int(listed[name].replace(",", "")), n)
        for name, n in files.items()
        if abs(int(listed[name].replace(",", "")) - n) > max(5, n // 10)
    }
    assert not stale, f"line counts on the page (page, wc -l) more than 10% off: {stale}"


def test_the_chinese_edition_shows_the_same_code():
    assert code_blocks(PAGE_ZH, "diff") == code_blocks(PAGE, "diff")
    assert user_module(PAGE_ZH) == user_module(PAGE)


# ----------------------------------------------------------------------------- the copies run
@pytest.mark.parametrize("script", sorted(BATCH))
def test_the_copy_trains_the_same_on_1_and_2_processes(script, tmp_path):
    copy = make_copy(tmp_path / "copy", script)
    two, one = train(copy, script, 2, "runs/two"), train(copy, script, 1, "runs/one")
    losses = {}
    for run in (one, two):
        records = read_metrics(run)
        losses[run] = {r["step"]: r["loss"] for r in records if r["type"] == "train"}
        evals = [r for r in records if r["type"] == "eval"]
        assert [r["step"] for r in evals] == [4, 8], evals
        assert all(r["num_samples"] == 256 and {"eval_loss", "mae", "r2"} <= set(r) for r in evals), evals
        assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] and 0 < evals[-1]["r2"] < 1, evals
        assert (run / "model" / "model.safetensors").is_file()
    assert_same_losses(losses[one], losses[two], range(1, 9), tol=1e-5)
    assert losses[one][8] < losses[one][1]


def test_a_loss_returned_as_a_mean_is_refused_at_start(tmp_path):
    copy = make_copy(tmp_path / "copy", "train_fsdp.py")
    module = (copy / "regression.py").read_text()
    (copy / "regression.py").write_text(module.replace(LOSS_LINE, LOSS_LINE.replace('"sum"', '"mean"')))
    result = run_copy(copy, [sys.executable, "train_fsdp.py", *FLAGS, "--output_dir", "runs/mean"])
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1, f"exit {result.returncode}\n{result.stderr[-3000:]}"
    assert errors[0].startswith(MEAN_ERROR) and "use reduction='sum'" in errors[0], errors[0]
    shown = [masked(line) for line in code_blocks(PAGE, "")]
    assert any(masked(errors[0]) in block for block in shown), f"the page should show the line: {errors[0]}"
    assert not (copy / "runs" / "mean" / "metrics.jsonl").exists()  # refused before anything is written
