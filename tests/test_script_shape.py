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


def step_functions(tree, main, loop) -> list:
    """The script's own step function, which the loop calls for the step's forward and backward: a
    function named *forward_backward (module-level, or nested in main), or the __call__ of a class of
    the script whose instance the loop calls (train_pp.py's pipeline)."""
    functions = {n.name: n for n in [*tree.body, *ast.walk(main)] if isinstance(n, ast.FunctionDef) and n is not main}
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    instances = {  # name = Class(...) in main, for a class of the script
        t.id: node.value.func.id
        for node in ast.walk(main)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Name)
        and node.value.func.id in classes
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    found = []
    for call in (n for n in ast.walk(loop) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)):
        name = call.func.id
        if name in functions and name.endswith("forward_backward"):
            found.append(functions[name])
        elif name in instances:
            found += [
                m for m in classes[instances[name]].body if isinstance(m, ast.FunctionDef) and m.name == "__call__"
            ]
    return found


def project_names_in_loop(path):
    """The training loop (the `while` of main()) and the script's step function it calls (its forward and
    backward), and the names from other project files they use: names imported from common/ or sibling
    scripts, and the attributes used on objects those build (feed, monitor, layout, task ...). Functions
    and classes defined in the script itself do not count; what they use does, for the step function."""
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
    bodies = [loop, *(statement for f in step_functions(tree, main, loop) for statement in f.body)]  # not annotations
    for part in bodies:
        for node in ast.walk(part):
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


# ----------------------------------------------------------------------------- a diff shows the strategy
# Each single-strategy script against its nearest sibling, and the tag that marks its strategy's lines
NEAREST_SIBLING = {
    "train_localsgd.py": "train_ddp.py",
    "train_fsdp.py": "train_ddp.py",
    "train_tp.py": "train_fsdp.py",
    "train_pp.py": "train_fsdp.py",
    "train_cp.py": "train_fsdp.py",
    "train_ep.py": "train_fsdp.py",
}
STRATEGY_TAG = {
    "train_ddp.py": "DDP",
    "train_localsgd.py": "Local SGD|DiLoCo",
    "train_fsdp.py": "FSDP|HSDP",
    "train_tp.py": "TP",
    "train_pp.py": "PP|pipeline",
    "train_cp.py": "CP",
    "train_ep.py": "EP|MoE",
}
MAX_CHANGED_OUTSIDE = 40  # issue 29


def strategy_lines(script: str) -> set[int]:
    """The line numbers of `script` that belong to its strategy, which a diff is meant to show:
    - the module docstring (the strategy explained) and the import statements (what its code uses);
    - every section whose header names the strategy (`# ==== FSDP: the strategy`, `# ---- TP: ...`,
      `# ==== MODEL: the TP plan`) and the strategy's flag group (add_argument_group .. parse_args);
    - every line marked with the strategy's tag in a comment (`# FSDP: ...`);
    - blank lines."""
    tag, text = STRATEGY_TAG[script], (SCRIPTS / script).read_text()
    lines = text.splitlines()
    docstring_end = text[: text.index('"""', text.index('"""') + 3) + 3].count("\n") + 1
    own = set(range(1, docstring_end + 1))
    for node in ast.parse(text).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            own |= set(range(node.lineno, node.end_lineno + 1))
    in_section = in_flags = False
    for number, line in enumerate(lines, 1):
        header = re.match(r"\s*# (?:={8,}|-{8,}) ?(.*)", line)
        if header:
            in_section = bool(re.search(rf"\b({tag})\b", header.group(1).split("(")[0]))
        in_flags = in_flags or "parser.add_argument_group(" in line
        if in_section or in_flags or not line.strip() or re.search(rf"#\s*({tag}):", line):
            own.add(number)
        in_flags = in_flags and "parser.parse_args()" not in line
    return own


def changed_outside_the_strategy(a: str, b: str) -> list[str]:
    """The lines `diff scripts/A scripts/B` shows (removed from A, added in B) that belong to neither
    script's strategy (strategy_lines): what a learner must read past to see the strategy."""
    out = subprocess.run(["diff", str(SCRIPTS / a), str(SCRIPTS / b)], capture_output=True, text=True).stdout
    (own_a, lines_a), (own_b, lines_b) = [(strategy_lines(s), (SCRIPTS / s).read_text().splitlines()) for s in (a, b)]
    changed = []
    for hunk in re.finditer(r"^(\d+)(?:,(\d+))?([acd])(\d+)(?:,(\d+))?$", out, re.M):
        a1, a2, kind, b1, b2 = int(hunk[1]), int(hunk[2] or hunk[1]), hunk[3], int(hunk[4]), int(hunk[5] or hunk[4])
        if kind != "a":
            changed += [f"{a}:{n}: {lines_a[n - 1]}" for n in range(a1, a2 + 1) if n not in own_a]
        if kind != "d":
            changed += [f"{b}:{n}: {lines_b[n - 1]}" for n in range(b1, b2 + 1) if n not in own_b]
    return changed


@pytest.mark.parametrize("script", sorted(NEAREST_SIBLING))
def test_a_diff_with_the_nearest_sibling_shows_the_strategy(script):
    """A learner diffs two scripts and sees the strategy and little else: at most MAX_CHANGED_OUTSIDE changed
    lines outside the strategy's own lines (train_fsdp.py against train_ddp.py was 298 lines in all once)."""
    sibling = NEAREST_SIBLING[script]
    changed = changed_outside_the_strategy(sibling, script)
    print(f"\n{script} against {sibling}: {len(changed)} changed lines outside the strategy")
    assert len(changed) <= MAX_CHANGED_OUTSIDE, (
        f"diff scripts/{sibling} scripts/{script}: {len(changed)} changed lines outside the strategy (at most "
        f"{MAX_CHANGED_OUTSIDE}); make the shared lines alike, or mark a strategy line with its tag:\n"
        + "\n".join(changed)
    )


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
