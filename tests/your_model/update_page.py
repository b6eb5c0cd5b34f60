#!/usr/bin/env python
"""Rewrite the worked examples' diffs and figures on docs/your-model.md (the first path),
docs/your-model-reference.md and their Chinese editions after the lessons changed (tests/test_your_model.py,
tests/test_batchnorm.py or tests/test_your_model_gru.py then fail: a diff no longer applies, or a figure is
stale), and say which files of scripts/common/ the references' table misses or names in vain.

    python tests/your_model/update_page.py

It makes the examples' copies as the pages describe them, from the lessons as they are now: the flags'
add_builtin_flags lines are dropped, the data line (`data = load_data(...)`) becomes the example's data, the
model line (`model, task = language_model(args, data)`) the example's model, and in train_tp.py the built-in
GPT's plan (its last two lines: `check_gpt_...` and `return tensor_parallel_plan(...)`) the regression's. Then
it writes `diff -u` of each copy into whichever page holds it (a ```diff block headed by its label), and the
+/- figures per section into the tables' rows. The pages hold no line counts (they go stale). What the runs
print (the start lines, the evaluations, the error lines) is not rewritten: run the copies to check those
(the pages say how)."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"
DOCS = REPO / "docs"
# (language, page): the first path holds the regression's module and train_ddp.py's diff, the reference the rest
PAGES = {
    ("en", "first"): DOCS / "your-model.md",
    ("en", "reference"): DOCS / "your-model-reference.md",
    ("zh", "first"): DOCS / "zh" / "your-model.md",
    ("zh", "reference"): DOCS / "zh" / "your-model-reference.md",
}
SCRIPT_NAMES = ("train_ddp.py", "train_fsdp.py", "train_tp.py")
# the second example, a CNN classifier with BatchNorm: its diffs are labelled digits/<script> (patch -p1)
DIGITS_SCRIPTS = ("train_ddp.py", "train_fsdp.py", "train_localsgd.py")
DIGITS_DATA = """    from digits import digits_data  # your data, model and Task: digits.py, beside this copy

    data = digits_data()
"""
DIGITS_MODEL = """    from digits import DigitsCNN, DigitsTask

    model, task = DigitsCNN(), DigitsTask()
"""
# the third, a GRU language model (word_language_model's RNNModel): its diffs are labelled gru/<script>
GRU_SCRIPTS = ("train_ddp.py", "train_fsdp.py")
GRU_DATA = """    from rnn_lm import text_data  # your data, model and Task: rnn_lm.py, beside this copy

    data = text_data()
"""
GRU_MODEL = """    from rnn_lm import RNNLMTask, RNNModel

    model, task = RNNModel(), RNNLMTask()
"""
EXAMPLES = (("digits", DIGITS_SCRIPTS, DIGITS_DATA, DIGITS_MODEL), ("gru", GRU_SCRIPTS, GRU_DATA, GRU_MODEL))

DATA = """    from types import SimpleNamespace

    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(0)  # your batches; a fixed seed: the same samples on every rank
    x = torch.randn(2304, 16, generator=g)
    y = torch.sin(x[:, :8]).sum(1, keepdim=True) + 0.1 * torch.randn(2304, 1, generator=g)
    train, validation = TensorDataset(x[:2048], y[:2048]), TensorDataset(x[2048:], y[2048:])  # rows (x, y)
    data = SimpleNamespace(train=train, validation=validation, name="synthetic regression")
"""
MODEL = """    from regression import RegMLP, RegressionTask  # your model and its Task: regression.py, beside this copy

    model, task = RegMLP(), RegressionTask()
"""
PLAN = """    plan = {}
    for i in range(len(model.layers)):  # regression.py's RegMLP: Megatron's pair, fc1 column-wise, fc2 row-wise
        plan.update({f"layers.{i}.fc1": ColwiseParallel(), f"layers.{i}.fc2": RowwiseParallel()})
    return plan
"""
GPT_PLAN = (  # model_tp_plan's last two lines: the GPT's check, then its plan
    r"^    check_gpt_\w+\(.*\n"
    r"    return tensor_parallel_plan\(model, sequence_parallel, loss_parallel\)\n"
)


# the flags section's two lines that add the built-in data sets' and models' flags: a copy drops them
BUILTIN_FLAGS = r"^    from common\.builtin_flags import add_builtin_flags.*\n\n    add_builtin_flags\(.*\n"


def replace_once(pattern: str, new: str, text: str, what: str) -> str:
    text, n = re.subn(pattern, lambda _: new, text, flags=re.M)
    if n != 1:
        sys.exit(f"update_page.py: found {n} places for {what}: edit the recipe at the top of this file")
    return text


def edit(script: str, text: str, data: str = DATA, model: str = MODEL) -> str:
    """The page's adaptation of `script`, as a recipe that survives changes around it."""
    text = replace_once(BUILTIN_FLAGS, "", text, "the built-in flags (add_builtin_flags)")
    text = replace_once(r"^    data = load_data\(.*\)\n", data, text, "the data line")
    text = replace_once(
        r"(^    # .*\n)*^    model, task = language_model\(args, data(?:, on_meta=True)?\)(?:  #.*)?\n",
        model,
        text,
        "the model line",
    )
    if model is not MODEL:
        return text
    if script == "train_tp.py":
        text = replace_once(GPT_PLAN, PLAN, text, "the built-in GPT's TP plan")
    return text


def section_of_lines(text: str) -> list[str | None]:
    """Each line's section: the word after the last `# ----` / `# ====` marker above it."""
    names, current = [], None
    for line in text.splitlines():
        marker = re.match(r"^\s*# (?:-{8,}|={8,}) (\w+)", line)
        if marker:
            current = "MODEL's TP plan" if "TP plan" in line else marker.group(1)
        names.append(current)
    return names


def changes_per_section(original: str, diff: str) -> dict[str, list[int]]:
    """{section: [added, removed]} in the order the diff meets them."""
    sections, per, n = section_of_lines(original), {}, 0
    for line in diff.splitlines()[2:]:
        hunk = re.match(r"@@ -(\d+)", line)
        if hunk:
            n = int(hunk.group(1))
        elif line.startswith("-"):
            per.setdefault(sections[n - 1], [0, 0])[1] += 1
            n += 1
        elif line.startswith("+"):
            per.setdefault(sections[n - 2], [0, 0])[0] += 1
        else:
            n += 1
    return per


def figures_row(script: str, per: dict, lang: str) -> str:
    """The row of the reference's table of the regression's copies: the lines changed, per section."""
    added, removed = sum(a for a, _ in per.values()), sum(r for _, r in per.values())
    if lang == "zh":
        names = {"MODEL's TP plan": "MODEL 中的 TP 方案"}
        parts = "，".join(f"{names.get(k, k)} +{a} −{r}" for k, (a, r) in per.items())
        return f"| `{script}` | +{added} −{removed}（{parts}） |"
    parts = ", ".join(f"{k} +{a} −{r}" for k, (a, r) in per.items())
    return f"| `{script}` | +{added} −{removed} ({parts}) |"


def module_summary(path: Path) -> str:
    """The first sentence of a module's docstring: a start for its row in the references' table."""
    import ast

    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    return " ".join(doc.split("\n\n")[0].split(". ")[0].split())  # of its first paragraph


def write_diff(texts: dict, label: str, diff: str) -> None:
    """The diff into every page that holds a ```diff block headed by `label`."""
    for key in texts:
        texts[key] = re.sub(
            rf"^```diff\n--- {re.escape(label)}\n.*?^```\n",
            lambda _: f"```diff\n{diff}```\n",
            texts[key],
            flags=re.M | re.S,
        )


def main() -> None:
    texts = {key: path.read_text(encoding="utf-8") for key, path in PAGES.items()}
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for script in SCRIPT_NAMES:
            original = (SCRIPTS / script).read_text(encoding="utf-8")
            copy = Path(tmp) / script
            copy.write_text(edit(script, original), encoding="utf-8")
            labels = ["--label", script, "--label", script]
            diff = subprocess.run(
                ["diff", "-u", *labels, str(SCRIPTS / script), str(copy)], capture_output=True, text=True
            )
            per = changes_per_section(original, diff.stdout)
            write_diff(texts, script, diff.stdout)
            for (lang, page), text in texts.items():
                row = figures_row(script, per, lang)
                texts[(lang, page)] = re.sub(rf"^\| `{re.escape(script)}` \|.*$", lambda _, r=row: r, text, flags=re.M)
            rows[script] = figures_row(script, per, "en")
        for example, script, data, model in ((e, s, d, m) for e, scripts, d, m in EXAMPLES for s in scripts):
            original = (SCRIPTS / script).read_text(encoding="utf-8")  # the CNN's, the GRU's: data and MODEL only
            copy = Path(tmp) / f"{example}_{script}"
            copy.write_text(edit(script, original, data, model), encoding="utf-8")
            label = f"{example}/{script}"
            diff = subprocess.run(
                ["diff", "-u", "--label", label, "--label", label, str(SCRIPTS / script), str(copy)],
                capture_output=True,
                text=True,
            )
            per = changes_per_section(original, diff.stdout)
            added, removed = sum(a for a, _ in per.values()), sum(r for _, r in per.values())
            write_diff(texts, label, diff.stdout)
            for key, text in texts.items():
                texts[key] = re.sub(
                    rf"^(\| `{re.escape(label)}` \| )\+\d+ −\d+",
                    lambda m, a=added, r=removed: f"{m.group(1)}+{a} −{r}",
                    text,
                    flags=re.M,
                )
            rows[label] = f"{label}: +{added} −{removed} {per}"
    for key, path in PAGES.items():
        path.write_text(texts[key], encoding="utf-8")
    print("\n".join(rows.values()))
    files = sorted(p.name for p in (SCRIPTS / "common").glob("*.py"))
    for lang in ("en", "zh"):
        listed = set(re.findall(r"^\| `common/(\w+\.py)` \|", texts[(lang, "reference")], re.M))
        page = PAGES[(lang, "reference")].relative_to(REPO)
        for name in sorted(listed - set(files)):
            print(f"{page}: common/{name} is gone: remove its row")
        for name in (n for n in files if n not in listed):
            summary = module_summary(SCRIPTS / "common" / name)
            print(f"{page}: add a row for common/{name}: | `common/{name}` | {summary} |")


if __name__ == "__main__":
    main()
