"""docs/your-model.md (the first path) and docs/your-model-reference.md (the reference behind it): copying a
lesson to train a model of your own is a documented, tested act.

The first path's worked example is done here as a user would do it, from the pages themselves: its
regression.py (the ```python block holding `class RegressionTask`) and the diffs (```diff blocks headed
`--- train_ddp.py` / `+++ train_ddp.py` on the first path, train_fsdp.py's and train_tp.py's in the reference)
are applied with `patch` to copies of scripts/<script> and scripts/common/ in a folder outside the repository,
and the copy runs there: on 2 processes and on 1, fp32, 8 steps; the per-step losses must agree within 1e-5 and
the runs' metrics.jsonl must hold the example's own evaluation (eval_loss, mae, r2). The first path's edit for
PP (its stage_modules) and EP (its RegMoE), and the reference's causal LM for CP, train the same way. The loss
turned into a mean must stop the copy at start with the page's one error line. The pages' claims are checked
too: the first path is short and names each lesson's edit, the diffs touch only the data and MODEL sections,
the figures of lines changed are the diffs', every file of common/ is named (no line counts: they go stale),
links into the pages find their anchors, and the Chinese edition shows the same code.
tests/your_model/update_page.py rewrites the diffs and figures after the lessons change."""

from __future__ import annotations

import difflib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CPU_MULTI, REPO, SCRIPTS, assert_same_losses, free_port, job_env, kill_tree, read_metrics

PAGE = REPO / "docs" / "your-model.md"  # the first path
PAGE_ZH = REPO / "docs" / "zh" / "your-model.md"
REFERENCE = REPO / "docs" / "your-model-reference.md"  # the reference behind it
REFERENCE_ZH = REPO / "docs" / "zh" / "your-model-reference.md"
FIRST_PATH_MAX_LINES = 300  # issue 56: ~1,050 lines were read before the first 2-process run
FENCED = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)
DIFF_HEADER = re.compile(r"--- (\S+)\n\+\+\+ (\S+)\n")
SECTION = re.compile(r"^\s*# (?:-{8,}|={8,}) (\w+)")  # a script's section marker: `# ----...---- data ...`
EDITABLE = {"data", "MODEL"}
# 8 fp32 steps, a train record every step, two evaluations; --batch_size per process count below
FLAGS = ["--max_steps", "8", "--log_every", "1", "--eval_every", "4", "--warmup_steps", "2", "--eval_batch_size", "64"]
# the global batch is the same at 1 and 2 processes: DDP and FSDP split it over the ranks, TP does not
BATCH = {"train_ddp.py": {1: "64", 2: "32"}, "train_fsdp.py": {1: "64", 2: "32"}, "train_tp.py": {1: "64", 2: "64"}}
# the first path's edit for PP and EP: the pipeline reads the whole batch on every stage; EP splits it
LESSON_BATCH = {"train_pp.py": {1: "64", 2: "64"}, "train_ep.py": {1: "64", 2: "32"}}
LOSS_LINE = 'F.mse_loss(outputs.float(), targets, reduction="sum")'
MEAN_ERROR = "error: the loss of a micro-batch is not a sum: "


def code_blocks(path: Path, language: str) -> list[str]:
    return [body for lang, body in FENCED.findall(path.read_text(encoding="utf-8")) if lang == language]


def page_diffs(*paths: Path) -> dict[str, str]:
    """{script: its diff} from the pages' ```diff blocks, named by their `--- x` / `+++ x` header (the first
    path's and the reference's, English, unless `paths` are given)."""
    diffs = {}
    for body in [b for path in paths or (PAGE, REFERENCE) for b in code_blocks(path, "diff")]:
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


def python_block(path: Path, holding: str) -> str:
    """The page's one ```python block that holds `holding`."""
    found = [body for body in code_blocks(path, "python") if holding in body]
    assert len(found) == 1, f"{path.name}: expected one ```python block with {holding!r}, found {len(found)}"
    return found[0]


def added_lines(diff: str, removed: str) -> str:
    """The lines a diff's hunk adds in place of the line starting with `removed` (its data or model line)."""
    hunk = next(h for h in re.split(r"^@@.*\n", diff, flags=re.M) if f"\n-{removed}" in f"\n{h}")
    return "".join(line[1:] + "\n" for line in hunk.splitlines() if line.startswith("+"))


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


def train(folder: Path, script: str, nproc: int, out: str, flags=FLAGS, batch=None) -> Path:
    """`python <script>` for 1 process, `accelerate launch` with cpu_multi.yaml for 2: the page's commands."""
    batch = batch or {**BATCH, **LESSON_BATCH}[script][nproc]
    args = [script, *flags, "--batch_size", batch, "--output_dir", out]
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
    text = REFERENCE.read_text(encoding="utf-8")  # the table of the regression's copies
    row = next((line for line in text.splitlines() if line.startswith(f"| `{script}`")), "")
    assert f"+{added} −{removed}" in row, f"the page's figures row for {script} should say +{added} −{removed}: {row!r}"


@pytest.mark.parametrize("page", [REFERENCE, REFERENCE_ZH], ids=["en", "zh"])
def test_every_file_of_common_is_listed(page):
    """By name, with what it holds, and no line count (they go stale): `python tests/your_model/update_page.py`
    says which files the table misses or names in vain."""
    rows = re.findall(r"^\| `common/(\w+\.py)` \| (.*) \|$", page.read_text(encoding="utf-8"), re.M)
    listed, files = {name for name, _ in rows}, {p.name for p in (SCRIPTS / "common").glob("*.py")}
    assert listed == files, f"common/ holds {sorted(files - listed)} that {page.name} does not name, and not " + (
        f"{sorted(listed - files)} that it does (python tests/your_model/update_page.py)"
    )
    counted = [name for name, held in rows if re.match(r"[\d,]+ \|", held) or not held.strip()]
    assert not counted, f"{page.name}: rows with a line count, or nothing said of the file: {counted}"


def test_the_chinese_edition_shows_the_same_code():
    for english, chinese in ((PAGE, PAGE_ZH), (REFERENCE, REFERENCE_ZH)):
        assert code_blocks(chinese, "diff") == code_blocks(english, "diff"), chinese.name
        assert code_blocks(chinese, "python") == code_blocks(english, "python"), chinese.name
    assert user_module(PAGE_ZH) == user_module(PAGE)


@pytest.mark.parametrize("page", [PAGE, PAGE_ZH], ids=["en", "zh"])
def test_the_first_path_is_short_and_names_each_lessons_edit(page):
    """What a learner reads before the first 2-process run of their own model, and the edit of every lesson:
    TP's plan, PP's stage builder, CP's two Task methods, EP's experts; nn.Sequential and fused projections."""
    text = page.read_text(encoding="utf-8")
    n = len(text.splitlines())
    assert n <= FIRST_PATH_MAX_LINES, f"{page.name}: {n} lines, the first path is at most {FIRST_PATH_MAX_LINES}"
    for named in ("model_tp_plan", "def stage_modules(", "set_attention", "forward_at", "experts_of", "MoE("):
        assert named in text, f"{page.name} should name {named}"
    for named in ("nn.Sequential", "qkv", "train_ddp.py", "accelerate launch --config_file cpu_multi.yaml"):
        assert named in text, f"{page.name} should name {named}"
    assert "your-model-reference.md" in text, f"{page.name} should lead to the reference"


def heading_anchors(text: str) -> set[str]:
    """The anchors of a page: GitHub's slug of each heading, and every `<a id="...">`."""
    found, fenced = set(), False
    for line in text.splitlines():
        if re.match(r"^\s*```", line):
            fenced = not fenced
        elif not fenced:
            heading = re.match(r"^#{1,6} (.*)$", line)
            if heading:
                found.add(re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-"))
            found.update(re.findall(r'<a id="([^"]+)"', line))
    return found


def test_links_into_the_pages_find_their_anchors():
    """README, docs/ and the Chinese edition link to sections of these pages: each anchor is there."""
    pages = {
        p.resolve(): heading_anchors(p.read_text(encoding="utf-8")) for p in (PAGE, PAGE_ZH, REFERENCE, REFERENCE_ZH)
    }
    missing = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        text = re.sub(r"^\s*```.*?^\s*```", "", doc.read_text(encoding="utf-8"), flags=re.M | re.S)
        for target, anchor in re.findall(r"\]\(([^)\s#]*your-model[\w-]*\.md|)#([^)\s]+)\)", text):
            page = (doc.parent / target).resolve() if target else doc.resolve()
            if page in pages and anchor not in pages[page]:
                missing.append(f"{doc.relative_to(REPO)} -> {target}#{anchor}")
    assert not missing, f"links to anchors the pages do not have: {missing}"


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
    shown = [masked(line) for line in code_blocks(PAGE, "")]  # the first path shows it
    assert any(masked(errors[0]) in block for block in shown), f"the page should show the line: {errors[0]}"
    assert not (copy / "runs" / "mean" / "metrics.jsonl").exists()  # refused before anything is written


# ----------------------------------------------------------------------------- the first path's edit of PP, EP; CP
def lesson_copy(folder: Path, script: str, module: str, model_lines: str, data: bool = True) -> Path:
    """A copy of `script` and common/ outside the repository, `module` beside it as the file its MODEL lines
    import; the data lines (`data=True`: the first path's regression data, and the built-in flags dropped)
    and the model line replaced as the first path's diff of train_ddp.py replaces them."""
    assert REPO not in folder.resolve().parents
    folder.mkdir(parents=True)
    shutil.copytree(SCRIPTS / "common", folder / "common", ignore=shutil.ignore_patterns("__pycache__"))
    text = (SCRIPTS / script).read_text()
    if data:
        ddp = page_diffs(PAGE)["train_ddp.py"]
        text, n = re.subn(
            r"^    data = load_data\(.*\)\n", lambda _: added_lines(ddp, "    data = load_data("), text, flags=re.M
        )
        assert n == 1, f"{script}: no data line to replace"
    if data:
        flags = r"^    from common\.builtin_flags import add_builtin_flags.*\n\n    add_builtin_flags\(.*\n"
        text, n = re.subn(flags, "", text, flags=re.M)
        assert n == 1, f"{script}: no add_builtin_flags lines to drop"
    text, n = re.subn(r"^    model, task = language_model\(args, data.*\n", lambda _: model_lines, text, flags=re.M)
    assert n == 1, f"{script}: no model line to replace"
    (folder / script).write_text(text)
    name = re.search(r"from (\w+) import", model_lines).group(1)
    (folder / f"{name}.py").write_text(module)
    return folder


def regression_model_lines(model: str = "RegMLP()") -> str:
    lines = added_lines(page_diffs(PAGE)["train_ddp.py"], "    model, task = language_model(")
    assert "RegMLP()" in lines, lines
    return lines.replace("RegMLP()", model).replace("import RegMLP,", f"import {model[:-2]},")


def pp_copy(folder: Path) -> Path:
    """train_pp.py for the regression, its stage_modules the first path's."""
    copy = lesson_copy(folder, "train_pp.py", user_module(), regression_model_lines())
    lines = (copy / "train_pp.py").read_text().splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith("def stage_modules("))
    end = next(
        i
        for i in range(start + 1, len(lines))
        if lines[i].strip() and not lines[i][0].isspace() and lines[i][0] not in ")]"
    )
    builder = python_block(PAGE, "def stage_modules(")
    (copy / "train_pp.py").write_text("".join([*lines[:start], builder, "\n\n", *lines[end:]]))
    return copy


def ep_copy(folder: Path) -> Path:
    """train_ep.py for the regression's RegMoE: the first path's MoE blocks added to regression.py; the copy
    drops its add_builtin_flags lines like every other (its experts are counted once the model is built)."""
    module = user_module() + "\n\n" + python_block(PAGE, "class MoEBlock(")
    return lesson_copy(folder, "train_ep.py", module, regression_model_lines("RegMoE()"))


def cp_copy(folder: Path) -> Path:
    """train_cp.py for the reference's causal LM of one's own (tiny_lm.py), on the built-in data."""
    module = python_block(REFERENCE, "class TinyLM(nn.Module)")
    model_lines = next(b for b in code_blocks(REFERENCE, "text") if "from tiny_lm import" in b)
    return lesson_copy(folder, "train_cp.py", module, model_lines, data=False)


def test_the_first_paths_cp_lines_are_the_references_model():
    """The first path shows a part of the reference's tiny_lm.py: the same lines."""
    whole = {line.strip() for line in python_block(REFERENCE, "class TinyLM(nn.Module)").splitlines()}
    shown = python_block(PAGE, "class TinyLMTask(")
    assert all(line.strip() in whole for line in shown.splitlines()), shown
    tp = python_block(PAGE, "plan = {}")  # and TP's plan is the reference's diff's
    assert all(f"+{line}" in page_diffs()["train_tp.py"] for line in tp.splitlines()), tp


@pytest.mark.parametrize("lesson", ["pp", "ep", "cp"])
def test_the_lessons_edit_trains_the_same_on_1_and_2_processes(lesson, tmp_path, data_cache):
    copy = {"pp": pp_copy, "ep": ep_copy, "cp": cp_copy}[lesson](tmp_path / "copy")
    script = f"train_{lesson}.py"
    flags, batch = FLAGS, None
    if lesson == "cp":  # the built-in data: 4-digit additions, rows of 16 tokens
        flags = ["--addition_digits", "4", "--max_steps", "6", "--log_every", "1", "--eval_every", "0"]
        flags, batch = [*flags, "--data_cache_dir", data_cache], "8"
    two, one = train(copy, script, 2, "runs/two", flags, batch), train(copy, script, 1, "runs/one", flags, batch)
    losses = {run: {r["step"]: r["loss"] for r in read_metrics(run) if r["type"] == "train"} for run in (one, two)}
    steps = range(1, 7 if lesson == "cp" else 9)
    assert_same_losses(losses[one], losses[two], steps, tol=1e-5)
    assert (two / "model" / "model.safetensors").is_file()
