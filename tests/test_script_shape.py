"""The learning files read alone (issue 21): each script's training loop is short and uses few
names from other project files, only the MODEL section names the model, and a diff of two
scripts shows the strategy and little else. These read the sources; they launch nothing."""

import ast
import re
import subprocess

import pytest

from conftest import SCRIPTS

TRAINING_SCRIPTS = [
    "train_ddp.py",
    "train_localsgd.py",
    "train_fsdp.py",
    "train_tp.py",
    "train_pp.py",
    "train_hybrid.py",
    "train_ep.py",
    "train_cp.py",
]
MAX_LOOP_LINES, MAX_LOOP_NAMES = 30, 12


def project_names_in_loop(path):
    """The training loop (the `while` of main()) and the names from other project files it uses: names
    imported from common/ or sibling scripts, and the attributes used on objects those build (log, stream,
    layout, task ...). Functions and classes defined in the script itself do not count."""
    tree = ast.parse(path.read_text())
    imported = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and node.module
        and node.module.split(".")[0] in ("common", *[s.removesuffix(".py") for s in TRAINING_SCRIPTS])
        for alias in node.names
    }
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    loop = next(n for n in ast.walk(main) if isinstance(n, ast.While))
    objects = {"task"}  # built by the MODEL section's project function (language_model)
    for node in ast.walk(main):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = node.value.func
            root = func.value if isinstance(func, ast.Attribute) else func
            if isinstance(root, ast.Name) and root.id in imported and root.id[0].isupper():
                objects |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    used = set()
    for node in ast.walk(loop):
        if isinstance(node, ast.Name) and node.id in imported:
            used.add(node.id)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in objects:
            used.add(f"{node.value.id}.{node.attr}")
    return loop, used


@pytest.mark.parametrize("script", TRAINING_SCRIPTS)
def test_loop_is_short_and_uses_few_project_names(script):
    loop, used = project_names_in_loop(SCRIPTS / script)
    n_lines = loop.end_lineno - loop.lineno + 1
    assert n_lines <= MAX_LOOP_LINES, f"{script}: the training loop is {n_lines} lines (at most {MAX_LOOP_LINES})"
    names = {u.split(".")[-1] for u in used}
    assert len(names) <= MAX_LOOP_NAMES, f"{script}: the loop uses {len(names)} project names: {sorted(used)}"


def changed_lines(a: str, b: str) -> int:
    """What `diff scripts/A scripts/B` shows: lines removed (<) plus lines added (>)."""
    out = subprocess.run(["diff", str(SCRIPTS / a), str(SCRIPTS / b)], capture_output=True, text=True).stdout
    return sum(1 for line in out.splitlines() if line.startswith(("< ", "> ")) or line in ("<", ">"))


def test_diff_of_ddp_and_fsdp_shows_the_strategy():
    """A learner diffs two scripts and sees the strategy and little else (it was 298 lines, ~100 of them FSDP)."""
    assert changed_lines("train_ddp.py", "train_fsdp.py") <= 150


# Names of the built-in GPT and its config: only a MODEL section (and the model files) may use them.
GPT_NAMES = re.compile(r"\bGPT\(|\.blocks\b|\btok_emb\b|\bpos_emb\b|\blm_head\b|\bln_f\b|\bn_layer\b|\bmodel_config\b")


def outside_model_sections(text: str):
    """(line number, line) of the lines outside every section whose header names MODEL."""
    in_model = False
    for number, line in enumerate(text.splitlines(), 1):
        header = re.match(r"\s*# (=|-){10,} ?(.*)", line)
        if header:
            in_model = "MODEL" in header.group(2)
            continue
        if not in_model:
            yield number, line


@pytest.mark.parametrize("script", TRAINING_SCRIPTS)
def test_only_the_model_section_names_the_model(script):
    text = (SCRIPTS / script).read_text()
    docstring_end = text.index('"""', text.index('"""') + 3) + 3
    body_start = text[:docstring_end].count("\n") + 1
    hits = [
        f"{n}: {line.strip()}"
        for n, line in outside_model_sections(text)
        if n > body_start and GPT_NAMES.search(line.split("#")[0])
    ]
    assert not hits, f"{script} names the model outside its MODEL section:\n" + "\n".join(hits)
