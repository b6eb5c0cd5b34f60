#!/usr/bin/env python
"""Rewrite the worked example's diffs and figures on docs/your-model.md and docs/zh/your-model.md after
scripts/train_fsdp.py, scripts/train_tp.py or scripts/common/ changed (tests/test_your_model.py then
fails: a diff no longer applies, or a figure is stale).

    python tests/your_model/update_page.py

It makes the example's copies as the page describes them, from the scripts as they are now: the data
line (`data = load_data(...)`) becomes the synthetic data, the model line (`model, task =
language_model(args, data)`, with the comment lines right above it) becomes the regression model, and
in train_tp.py the built-in GPT's plan (`check_gpt_split` and `return tensor_parallel_plan(...)`)
becomes the regression's. Then it writes `diff -u` of each copy into both pages, the +/- figures per
section, and the line counts of the scripts and of common/. What the runs print (the start lines, the
evaluations, the error lines) is not rewritten: run the copies to check those (the page says how)."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"
PAGES = {"en": REPO / "docs" / "your-model.md", "zh": REPO / "docs" / "zh" / "your-model.md"}
SCRIPT_NAMES = ("train_fsdp.py", "train_tp.py")
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
GPT_PLAN = (
    r"^    check_gpt_split\(task\.cfg, layout\.tp\).*\n"
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


def figures_row(script: str, n_lines: int, common_lines: int, per: dict, module_lines: int, lang: str) -> str:
    added, removed = sum(a for a, _ in per.values()), sum(r for _, r in per.values())
    if lang == "zh":
        names = {"MODEL's TP plan": "MODEL 中的 TP 方案"}
        parts = "，".join(f"{names.get(k, k)} +{a} −{r}" for k, (a, r) in per.items())
        file = f"`regression.py`，{module_lines} 行" if script == "train_fsdp.py" else "同一个 `regression.py`"
        return f"| `{script}` | {n_lines} + {common_lines:,} | +{added} −{removed}（{parts}） | {file} |"
    parts = ", ".join(f"{k} +{a} −{r}" for k, (a, r) in per.items())
    file = f"`regression.py`, {module_lines} lines" if script == "train_fsdp.py" else "the same `regression.py`"
    return f"| `{script}` | {n_lines} + {common_lines:,} | +{added} −{removed} ({parts}) | {file} |"


def main() -> None:
    texts = {lang: path.read_text(encoding="utf-8") for lang, path in PAGES.items()}
    module = next(
        b for _, b in re.findall(r"^```(\w*)\n(.*?)^```$", texts["en"], re.M | re.S) if "class RegressionTask" in b
    )
    common = {
        p.name: len(p.read_text(encoding="utf-8").splitlines()) for p in sorted((SCRIPTS / "common").glob("*.py"))
    }
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
            for lang in texts:
                texts[lang] = re.sub(
                    rf"^```diff\n--- {re.escape(script)}\n.*?^```\n",
                    lambda _: f"```diff\n{diff.stdout}```\n",
                    texts[lang],
                    flags=re.M | re.S,
                )
                row = figures_row(
                    script, len(original.splitlines()), sum(common.values()), per, len(module.splitlines()), lang
                )
                texts[lang] = re.sub(rf"^\| `{re.escape(script)}` \|.*$", lambda _: row, texts[lang], flags=re.M)
                rows[(lang, script)] = row
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
            for lang in texts:
                texts[lang] = re.sub(
                    rf"^```diff\n--- {re.escape(label)}\n.*?^```\n",
                    lambda _: f"```diff\n{diff.stdout}```\n",
                    texts[lang],
                    flags=re.M | re.S,
                )
                texts[lang] = re.sub(
                    rf"^(\| `{re.escape(label)}` \| )[\d,]+( \| )\+\d+ −\d+",
                    lambda m: f"{m.group(1)}{len(original.splitlines())}{m.group(2)}+{added} −{removed}",
                    texts[lang],
                    flags=re.M,
                )
            rows[(example, script)] = f"{label}: {len(original.splitlines())} lines, +{added} −{removed} {per}"
    for lang, path in PAGES.items():
        for name, n in common.items():
            texts[lang] = re.sub(
                rf"^(\| `common/{re.escape(name)}` \| )[\d,]+ \|", rf"\g<1>{n:,} |", texts[lang], flags=re.M
            )
        path.write_text(texts[lang], encoding="utf-8")
    print("\n".join(rows.values()))
    missing = sorted(set(common) - set(re.findall(r"^\| `common/(\w+\.py)` \|", texts["en"], re.M)))
    if missing:
        print(f"add a row for each new file of common/ to both pages: {missing}")


if __name__ == "__main__":
    main()
