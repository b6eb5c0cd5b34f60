"""The ground floor a copy carries: how many lines of scripts/common/ a training script imports at run
time (tests/ground_floor.py runs it for real and counts the common.* modules it imported).

(a) Every training script, unedited, on the built-in GPT (one process): its figure is reported (`pytest -s`,
    and each test's `common_lines` property) and bounded (BUILT_IN_MAX_LINES); the 🤗 code (common/hf.py)
    is never imported, nor the mixture of experts (common/moe.py) by a dense model.
(b) A copy of train_ddp.py for a model of one's own (docs/your-model.md's MLP regression, with the data
    and MODEL sections replaced as the page's diffs replace them), outside the repository, on 2 processes:
    it imports neither the built-in GPT (common/model.py), nor the MoE, nor the 🤗 code; every common/
    module it imports is in one layer (LAYERS) or one guard (GUARDS), and each layer stays under its cap
    (LAYER_CAPS). The guards are counted each on its own and capped by none: a learner may delete any of
    their lines (tests/test_guards.py). On one process the guards that prove nothing are not imported.
(c) Imports go one way: no circle among the modules of scripts/ (lazy imports included), and no `_private`
    name of one taken by another, or by benchmarks/."""

from __future__ import annotations

import ast
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from conftest import REPO, SCRIPTS, job_env, launch_cmd, run_cmd

GROUND_FLOOR = Path(__file__).with_name("ground_floor.py")
TRAINING_SCRIPTS = [
    "train_ddp.py",
    "train_localsgd.py",
    "train_fsdp.py",
    "train_tp.py",
    "train_pp.py",
    "train_cp.py",
    "train_ep.py",
    "train_hybrid.py",
]
# 2 steps of the tiny model, evaluation only at the end: what every script imports on its way, and no more
FLAGS = ["--model_size", "tiny", "--max_steps", "2", "--batch_size", "8", "--warmup_steps", "1", "--eval_every", "0"]
# issue 56: a copy for a model of one's own, measured in layers at 2 processes (the single cap of issues 29-43,
# 2,005 lines at one process, is retired). Each common/ module the copy imports counts in one layer, or in one
# guard; a module that mixes layers counts in its larger one.
LAYERS = {
    "step path": (  # flags -> loop -> evaluation -> export: what a training loop calls
        "common",
        "common.cli",
        "common.errors",
        "common.loader",
        "common.training",
        "common.evaluation",
        "common.batchnorm",
        "common.task",  # the contract (its check is a guard: common/contract_check.py)
        "common.metrics",
        "common.checkpoint",
        "common.checkpoint_format",
        "common.checkpoint_save",  # a run that saves checkpoints
        "common.checkpoint_resume",  # a run that resumes
    ),
    "reporting": ("common.banner", "common.throughput", "common.costs", "common.collectives"),
    "plumbing": ("common.launch", "common.run_state", "common.faults", "common.peers", "common.sharded"),
}
GUARDS = {  # each started by its own line(s) of the script (tests/test_guards.py deletes them)
    "cut check": ("common.cut_check", "common.cut_probe", "common.layer_drop", "common.shrunk"),
    "output lock and resume checks": ("common.output_checks", "common.resume_checks"),
    "peer records": ("common.peer_records",),
    "contract check and trial export": ("common.contract_check",),
}
# the targets of issue 56, each at least 10% above what the copy reached (step path 1,149, reporting 117, plumbing
# 199). The step path misses its 700: training.py (197: the step feed's preemption, target count and dropout
# streams), checkpoint.py and checkpoint_format.py (299: where a run starts, the export written whole or not at all,
# the folder's names and records), metrics.py (183), task.py (179) and cli.py (122) are what a loop calls. (1,332
# before the contract check and trial export left task.py for their own guard, common/contract_check.py.)
LAYER_CAPS = {"step path": 1270, "reporting": 150, "plumbing": 250}
BUILT_IN_MODELS = ("common.model", "common.gpt", "common.moe", "common.hf")
# issue 43: each unedited script's figure on the built-in GPT is bounded too, about 3% above what it reached
# after checkpoint.py, faults.py and cut_check.py were split (before: ddp 3,850, localsgd 4,356, fsdp 4,396,
# tp 4,663, pp 4,727, cp 4,779, ep 4,753, hybrid 6,886; hybrid counts the lessons it composes). Issue 56's split of
# the checkpoint, cut check and fault modules moved no cap: what one process or a run that neither saves nor resumes
# does not need stays unimported (ddp 3,188, hybrid 6,443 then)
BUILT_IN_MAX_LINES = {  # script: cap  # reached
    "train_ddp.py": 3300,  # 3,217
    "train_localsgd.py": 3950,  # 3,833 (3,770 on the same common/ before the flags, Streaming DiLoCo's fragments and
    # the record of the fusions left the lesson for localsgd_checks.py and localsgd_state.py, 48 lines shorter)
    "train_fsdp.py": 3860,  # 3,774
    "train_tp.py": 4230,  # 4,102 (4,095 on the same common/ before its flags' help moved to tp_checks.py)
    "train_pp.py": 4310,  # 4,185 (4,158 on the same common/ before PipelineStep's predict and summary moved to
    # pp_costs.py, its flag's help to pp_checks.py)
    "train_cp.py": 4630,  # 4,493 (4,485 on the same common/ before its flags' help moved to cp_checks.py; 4,252
    # before the ring, loss and sinks left the lesson, 166 lines shorter)
    "train_ep.py": 4230,  # 4,131
    "train_hybrid.py": 6650,  # 6,461 (issue 56: it counts the lessons it imports, whose flags' help, step
    # docstrings and PipelineStep.predict came back to them; 6,273 before)
}


def common_lines(script: Path, args: list[str], cwd: Path | None = None) -> dict:
    """Run `python <script> <args>` through tests/ground_floor.py; its answer: returncode, lines, modules."""
    result = run_cmd([sys.executable, str(GROUND_FLOOR), str(script), *args], env=job_env())
    assert result.returncode == 0, result.stderr[-3000:]
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    assert answer["returncode"] == 0, f"{script.name} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return answer


def modules_line(answer: dict) -> str:
    return ", ".join(f"{name.removeprefix('common.')} {n}" for name, n in answer["modules"].items() if n)


@pytest.mark.parametrize("script", TRAINING_SCRIPTS)
def test_lines_each_script_imports(script, tmp_path, data_cache, record_property):
    answer = common_lines(SCRIPTS / script, [*FLAGS, "--data_cache_dir", data_cache, "--output_dir", str(tmp_path)])
    record_property("common_lines", answer["lines"])
    print(f"\n{script}: {answer['lines']} lines of common/ ({modules_line(answer)})")
    hf = [m for m in answer["modules"] if m == "common.hf" or m.startswith("common.hf_")]  # and its adapters
    assert not hf, f"{script} imports the 🤗 code for the built-in GPT: {hf}"
    if script != "train_ep.py":  # EP trains a mixture of experts; the others' default GPT is dense
        assert "common.moe" not in answer["modules"], f"{script} imports the MoE for a dense GPT"
    assert answer["lines"] <= BUILT_IN_MAX_LINES[script], (
        f"{script} imports {answer['lines']} lines of common/ (at most {BUILT_IN_MAX_LINES[script]})"
    )


# ----------------------------------------------------------------------------- a copy for a model of one's own
PAGE = REPO / "docs" / "your-model.md"
DATA_MARKER = "    # ---------------------------------------- data"
OWN_DATA = """\
    from types import SimpleNamespace

    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(0)  # your batches; a fixed seed: the same samples on every rank
    x = torch.randn(2304, 16, generator=g)
    y = torch.sin(x[:, :8]).sum(1, keepdim=True) + 0.1 * torch.randn(2304, 1, generator=g)
    train, validation = TensorDataset(x[:2048], y[:2048]), TensorDataset(x[2048:], y[2048:])  # rows (x, y)
    data = SimpleNamespace(train=train, validation=validation, name="synthetic regression")
"""
BUILTIN_FLAGS = r"^    from common\.builtin_flags import add_builtin_flags.*\n\n    add_builtin_flags\(.*\n"
OWN_MODEL = """\
    from regression import RegMLP, RegressionTask  # your model and its Task: regression.py, beside this copy

    model, task = RegMLP(), RegressionTask()
"""


def regression_module() -> str:
    """The page's regression.py: its ```python block that holds `class RegressionTask`."""
    blocks = re.findall(r"^```python\n(.*?)^```$", PAGE.read_text(encoding="utf-8"), re.M | re.S)
    found = [b for b in blocks if "class RegressionTask(Task)" in b]
    assert len(found) == 1, f"{PAGE.name}: expected one ```python block with class RegressionTask"
    return found[0]


def own_model_copy(folder: Path) -> Path:
    """train_ddp.py and common/ copied side by side, regression.py beside them; the copy's data section
    makes the regression's data (everything between the data marker and the train loader), its MODEL
    section the regression's model and Task (everything between set_seed and `model.to`), and its flags
    section drops the built-in data sets' and models' flags (the two add_builtin_flags lines)."""
    folder.mkdir(parents=True)
    shutil.copytree(SCRIPTS / "common", folder / "common", ignore=shutil.ignore_patterns("__pycache__"))
    (folder / "regression.py").write_text(regression_module())
    lines = (SCRIPTS / "train_ddp.py").read_text().splitlines(keepends=True)
    data = next(i for i, line in enumerate(lines) if line.startswith(DATA_MARKER))
    loader = next(i for i in range(data, len(lines)) if "train_loader = make_train_loader(" in lines[i])
    seed = next(i for i in range(loader, len(lines)) if lines[i].strip().startswith("set_seed(args.seed)"))
    to_device = next(i for i in range(seed, len(lines)) if "model = model.to(accelerator.device)" in lines[i])
    text = "".join([*lines[: data + 1], OWN_DATA, *lines[loader : seed + 1], OWN_MODEL, *lines[to_device:]])
    text, n = re.subn(BUILTIN_FLAGS, "", text, flags=re.M)  # the built-in data sets' and models' flags: not its
    assert n == 1, "train_ddp.py's flags section: no add_builtin_flags lines to drop"
    (folder / "train_ddp.py").write_text(text)
    return folder / "train_ddp.py"


OWN_FLAGS = ["--max_steps", "2", "--warmup_steps", "1", "--eval_every", "0"]


@pytest.fixture(scope="module")
def own_copy(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("own_model")
    assert REPO not in folder.resolve().parents
    return own_model_copy(folder / "copy")


@pytest.fixture(scope="module")
def own_model_run(own_copy) -> dict:
    """The copy on 2 processes, counted on rank 0."""
    out = own_copy.parent.parent / "run"
    result = run_cmd(launch_cmd("../tests/ground_floor.py", [str(own_copy), *OWN_FLAGS, "--output_dir", str(out)], 2))
    assert result.returncode == 0, f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    answer = json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])
    assert answer["returncode"] == 0, result.stderr[-3000:]
    print(f"\nown-model copy of train_ddp.py, 2 processes: {answer['lines']} lines of common/ ({modules_line(answer)})")
    return answer


def layer_lines(answer: dict) -> dict[str, int]:
    """{layer or guard: the lines of its modules the run imported}; every module in exactly one of them."""
    kinds = {**LAYERS, **GUARDS}
    owners = {module: kind for kind, modules in kinds.items() for module in modules}
    assert len(owners) == sum(map(len, kinds.values())), "a module in two layers"
    unplaced = sorted(m for m in answer["modules"] if m not in owners)
    assert not unplaced, f"modules in no layer (add them to LAYERS or GUARDS): {unplaced}"
    counted = dict.fromkeys(kinds, 0)
    for module, n in answer["modules"].items():
        counted[owners[module]] += n
    return counted


def test_own_model_copy_imports_no_built_in_model(own_model_run):
    built_in = [name for name in BUILT_IN_MODELS if name in own_model_run["modules"]]
    assert not built_in, f"the copy for a model of one's own imports {built_in}"


def test_own_model_copy_layers_stay_under_their_caps(own_model_run, record_property):
    counted = layer_lines(own_model_run)
    for kind, n in counted.items():
        record_property(kind.replace(" ", "_"), n)
    print("\n" + ", ".join(f"{kind} {n}" for kind, n in counted.items()))
    over = {layer: counted[layer] for layer, cap in LAYER_CAPS.items() if counted[layer] > cap}
    assert not over, f"layers over their caps {LAYER_CAPS}: {over} ({modules_line(own_model_run)})"
    assert all(counted[guard] for guard in GUARDS), f"a guard the 2-process copy did not run: {counted}"


def test_one_process_imports_no_guard_that_proves_nothing(own_copy):
    """One process cuts nothing and has no peer: the cut check's probe and the peer records stay unimported;
    a run that neither resumes nor saves reads no checkpoint."""
    answer = common_lines(own_copy, [*OWN_FLAGS, "--output_dir", str(own_copy.parent.parent / "run1")])
    idle = ("common.cut_probe", "common.layer_drop", "common.peer_records", "common.resume_checks")
    idle += ("common.checkpoint_save", "common.checkpoint_resume")
    imported = [module for module in idle if module in answer["modules"]]
    assert not imported, f"one process imports {imported}"
    layer_lines(answer)


# ----------------------------------------------------------------------------- imports go one way (issue 56)
def project_imports(path: Path) -> list[tuple[str, str, int]]:
    """(module imported, name taken or "", line) for each import of scripts/' own modules in `path`, lazy ones
    (inside functions) included: `from .checkpoint import x` in common/ is ("common.checkpoint", "x", line)."""
    lessons = {p.stem for p in SCRIPTS.glob("*.py")}
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (
            node.level or (node.module or "").split(".")[0] in {"common", *lessons}
        ):
            module = f"common.{node.module}" if node.level and node.module else node.module or "common"
            found += [(module if module != "common" else f"common.{a.name}", a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, "", node.lineno) for a in node.names if a.name.split(".")[0] in {"common", *lessons}]
    return found


def test_no_import_circle_in_scripts():
    """No module of scripts/ reaches itself through the imports (a lazy import is an arrow too)."""
    files = {f"common.{p.stem}": p for p in (SCRIPTS / "common").glob("*.py")}
    files |= {p.stem: p for p in SCRIPTS.glob("*.py")}
    graph = {name: {m for m, _, _ in project_imports(path) if m in files and m != name} for name, path in files.items()}

    circles, state = [], {}  # state: 1 on the current path, 2 done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for below in sorted(graph[module]):
            if state.get(below) == 1:
                circles.append([*path[path.index(below) :], below])
            elif below not in state:
                visit(below, [*path, below])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles[:5])


def test_no_private_name_imported_across_modules():
    """Neither scripts/ nor benchmarks/ takes a `_private` name from another module of scripts/: not by
    `from common.x import _y`, nor as `x._y` of a module imported whole (`from common import x`)."""
    taken = []
    for path in sorted([*SCRIPTS.rglob("*.py"), *(REPO / "benchmarks").glob("*.py")]):
        where = path.relative_to(REPO)
        imports = project_imports(path)
        taken += [f"{where}:{line} {m}.{name}" for m, name, line in imports if re.match(r"_[^_]", name)]
        whole = {name: m for m, name, _ in imports if m == f"common.{name}"}  # `from common import x`
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in whole:
                if re.match(r"_[^_]", node.attr):
                    taken.append(f"{where}:{node.lineno} {whole[node.value.id]}.{node.attr}")
    assert not taken, f"private names taken from another module: {taken}"
