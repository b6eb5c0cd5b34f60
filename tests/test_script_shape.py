"""The learning files read alone (issue 21): each script's training loop is short and uses few
names from other project files, only the MODEL section names the model, and a diff of two
scripts shows the strategy and little else. These read the sources; they launch nothing."""

import ast
import difflib
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
# Issue 43: a lesson is train_ddp.py's skeleton plus its strategy. Measured RAW, no line exempt:
#   changed = `diff scripts/train_ddp.py scripts/train_X.py | grep -c '^[<>]'`, lines = `wc -l`,
#   long = lines over 100 characters. Each cap is about 10% above what the redesign reached (the goal:
#   at most 300 changed and 450 lines for every single-strategy lesson; the lessons not redesigned yet
#   keep their old figures as caps, so that none grows back).
SHAPE_CAPS = {  # script: (changed lines, lines, long lines), each ~10% above the figures reached
    "train_fsdp.py": (255, 317, 22),  # 231, 288, 20
    "train_tp.py": (316, 338, 22),  # 287, 307, 20 (299, 315, 26 before its flags' help moved to tp_checks.py
    # and its step's docstring became train_ddp.py's)
    "train_pp.py": (346, 366, 9),  # 315, 333, 5 (issue 56: its flags' help, PipelineStep.predict and torch's
    # PipelineStage back in the lesson, stage_modules' refusal of a model of one's own; 271, 287, 8 before)
    "train_cp.py": (356, 390, 11),  # 324, 354, 7 (issue 56: its flags' help and its step's docstring back in the
    # lesson, the ring's algorithm imported from one module, common/context_parallel.py; 286, 324, 10 before;
    # 472, 497, 7 before its ring, loss and sinks moved to common/)
    "train_ep.py": (289, 325, 9),  # 262, 295, 8
    "train_localsgd.py": (380, 445, 14),  # 347, 409, 12 (issue 56: the algorithm in the lesson alone, composed:
    # split_fragments, finish and the resume back from common/, its flags' help written literally; 250, 320, 10
    # while the flags' help, the fragments and the fusions' record lived in common/; 302, 368, 15 before)
    "train_hybrid.py": (452, 442, 36),  # 406, 397, 32 (not a single-strategy lesson; was 410, 401)
}
# issue 43: at most 10% of a lesson's lines over 100 characters (before the re-wrap: train_ddp.py 47 of 194,
# train_tp.py 63 of 299, train_fsdp.py 81 of 259, train_hybrid.py 86 of 385)
MAX_LONG_SHARE = 0.10
SKELETON = "train_ddp.py"


def raw_diff(a: str, b: str) -> int:
    out = subprocess.run(["diff", str(SCRIPTS / a), str(SCRIPTS / b)], capture_output=True, text=True).stdout
    return sum(line.startswith(("<", ">")) for line in out.splitlines())


@pytest.mark.parametrize("script", sorted(SHAPE_CAPS))
def test_a_diff_with_the_skeleton_shows_the_strategy(script):
    """A learner diffs train_ddp.py and a lesson and sees the strategy: the raw diff, the lesson's length and
    its long lines stay under their caps (issue 43's figures, before: tp 770 changed, cp 902, pp 576)."""
    text = (SCRIPTS / script).read_text().splitlines()
    figures = (raw_diff(SKELETON, script), len(text), sum(len(line) > 100 for line in text))
    print(f"\n{script}: {figures[0]} lines changed against {SKELETON}, {figures[1]} lines, {figures[2]} long")
    for name, got, cap in zip(("changed lines", "lines", "lines over 100 characters"), figures, SHAPE_CAPS[script]):
        assert got <= cap, f"diff scripts/{SKELETON} scripts/{script}: {got} {name} (at most {cap})"


@pytest.mark.parametrize("script", TRAINING_SCRIPTS)
def test_few_lines_are_long(script):
    """A lesson reads without scrolling sideways: at most MAX_LONG_SHARE of its lines over 100 characters
    (the skeleton's long lines are the same in every lesson, so train_ddp.py counts too)."""
    text = (SCRIPTS / script).read_text().splitlines()
    long = [i for i, line in enumerate(text, 1) if len(line) > 100]
    share = len(long) / len(text)
    assert share <= MAX_LONG_SHARE, f"{script}: {len(long)} of {len(text)} lines over 100 characters: {long}"


LESSONS = [s.removesuffix(".py") for s in TRAINING_SCRIPTS]
# not redesigned yet (issue 43): what each still imports from a sibling lesson
STILL_IMPORTS: dict[str, set[str]] = {}


@pytest.mark.parametrize("script", [*TRAINING_SCRIPTS, "plan_layout.py", "evaluate.py"])
def test_no_lesson_imports_a_lesson(script):
    """A copy of a lesson needs no sibling script: only train_hybrid.py composes the lessons' apply
    functions; plan_layout.py and evaluate.py read the ground floor (common/)."""
    if script == "train_hybrid.py":
        return
    tree = ast.parse((SCRIPTS / script).read_text())
    imported = {
        (node.module if isinstance(node, ast.ImportFrom) else alias.name).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0)
        for alias in node.names
    }
    lessons = imported & set(LESSONS)
    assert lessons <= STILL_IMPORTS.get(script, set()), f"{script} imports the lesson(s) {sorted(lessons)}"


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


MAX_FUNCTION_LINES = 88  # issue 43: no function over 80 lines in a lesson (main() is the skeleton's, below)
MAX_HYBRID_MAIN_LINES = 132  # issue 43: train_hybrid.py's main() at most 120 lines (it was 218)


@pytest.mark.parametrize("script", TRAINING_SCRIPTS)
def test_no_function_of_a_lesson_is_long(script):
    """A learner reads a lesson's functions whole: none over MAX_FUNCTION_LINES (methods included).
    main() is the skeleton every lesson shares; train_hybrid.py's, which composes the others, is bounded too."""
    tree = ast.parse((SCRIPTS / script).read_text())
    sizes = {
        n.name: n.end_lineno - n.lineno + 1
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    main = sizes.pop("main")
    long = {name: n for name, n in sizes.items() if n > MAX_FUNCTION_LINES}
    assert not long, f"{script}: functions over {MAX_FUNCTION_LINES} lines: {long}"
    if script == "train_hybrid.py":
        assert main <= MAX_HYBRID_MAIN_LINES, f"{script}: main() is {main} lines (at most {MAX_HYBRID_MAIN_LINES})"


MAX_COMMON_FLOORS = 5  # issue 43: common/ was 8 floors deep (cli -> builtin_flags -> model -> hf -> ... -> batchnorm)


def common_imports() -> dict[str, set[str]]:
    """{module of common/: the modules of common/ it imports}, lazy imports included (a run that needs them
    climbs those floors too), imports for annotations only (under `if TYPE_CHECKING:`) left out."""
    graph = {}
    for path in sorted((SCRIPTS / "common").glob("*.py")):
        tree = ast.parse(path.read_text())
        typing_only = {
            id(node)
            for branch in ast.walk(tree)
            if isinstance(branch, ast.If) and getattr(branch.test, "id", None) == "TYPE_CHECKING"
            for node in ast.walk(branch)
        }
        graph[path.stem] = {
            node.module.split(".")[0] if node.level else node.module.split(".")[1]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
            and id(node) not in typing_only
            and node.module
            and (node.level == 1 or node.module.startswith("common."))
        }
    return graph


def test_common_is_few_floors_deep():
    """A reader who follows an import down from a lesson reaches the bottom of common/ within
    MAX_COMMON_FLOORS modules (a module counts as one floor; a cycle is not climbed twice)."""
    graph = common_imports()

    def deepest(module: str, seen: tuple) -> list[str]:
        below = [deepest(d, (*seen, module)) for d in graph.get(module, ()) if d in graph and d not in seen]
        return [module, *max(below, key=len, default=[])]

    chains = {m: deepest(m, ()) for m in graph}
    worst = max(chains.values(), key=len)
    print(f"\ncommon/ is {len(worst)} floors deep: {' -> '.join(worst)}")
    assert len(worst) <= MAX_COMMON_FLOORS, f"common/ is {len(worst)} floors deep: {' -> '.join(worst)}"


# ----------------------------------------------------------------------------- one skeleton in every main()
# issue 43 keeps "the same 35 lines of main() in all 8 scripts": the non-blank lines of train_ddp.py's main()
# that every lesson's main() holds too, in the same order (difflib's matching blocks). 41 after the redesign.
MIN_SHARED_MAIN_LINES = 38


def main_lines(script: str) -> list[str]:
    text = (SCRIPTS / script).read_text()
    main = next(n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == "main")
    return text.splitlines()[main.lineno - 1 : main.end_lineno]


def test_every_main_holds_the_same_skeleton():
    skeleton = main_lines(SKELETON)
    shared = {i for i, line in enumerate(skeleton) if line.strip()}
    for script in TRAINING_SCRIPTS:
        matcher = difflib.SequenceMatcher(None, skeleton, main_lines(script), autojunk=False)
        shared &= {b.a + k for b in matcher.get_matching_blocks() for k in range(b.size)}
    print(f"\n{len(shared)} lines of {SKELETON}'s main() are in every lesson's main(), in order")
    assert len(shared) >= MIN_SHARED_MAIN_LINES, (
        f"only {len(shared)} lines of {SKELETON}'s main() are in every lesson (at least {MIN_SHARED_MAIN_LINES})"
    )
