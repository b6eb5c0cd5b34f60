"""A learner's own model meets no traceback before step 1 (issue 56): copies of the lessons for a model of
the shape of a timm Vision Transformer (tests/vit_shaped.py: fused qkv, class token, blocks in an
nn.Sequential, drop path), their data and MODEL sections replaced as a learner replaces them.

- train_ep.py on a model without experts: one `error:` line naming experts_of and docs/ep.md, before the
  model is cut or checked;
- train_tp.py with its plan not written (model_tp_plan still the built-in GPT's): one line naming
  model_tp_plan and docs/tp.md;
- train_tp.py with a plan that cuts the fused qkv column-wise: one line naming the plan's entry and the fix;
  a plan that leaves it whole (the MLP's pair cut) trains as one process does;
- blocks in an nn.Sequential are units on 1 process as on 2: train_ddp.py (which asks for the units only
  on 2, in the layer drop's check) and train_fsdp.py (one FSDP unit per block) train alike.

The runs of one process count share one launch (conftest's run_in_turn); the fused plan's refusal is also
launched alone, so that its exit code and stderr are the launcher's."""

import re
import shutil
import sys

import pytest

from conftest import (
    CPU_MULTI,
    REPO,
    SCRIPTS,
    assert_same_losses,
    free_port,
    job_env,
    run_cmd,
    run_in_turn,
    train_losses,
)

sys.path.insert(0, str(SCRIPTS))  # vit_shaped imports common.task
sys.path.insert(0, str(REPO / "tests"))
import torch.nn as nn
import vit_shaped

from common.errors import UsageError
from common.task import find_units

DATA_MARKER = "    # ---------------------------------------- data"
BUILTIN_FLAGS = r"^    from common\.builtin_flags import add_builtin_flags.*\n\n    add_builtin_flags\(.*\n"
GPT_PLAN = r"^    check_gpt_plan\(model, task, .*\n    return tensor_parallel_plan\(.*\n"
PLAN = """\
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {{}}
    for i in range(len(model.blocks)):  # the ViT's blocks: {what}
        plan.update({{f"blocks.{{i}}.{first}": ColwiseParallel(), f"blocks.{{i}}.{second}": RowwiseParallel()}})
    return plan
"""
FUSED_PLAN = PLAN.format(what="attention's qkv column-wise, proj row-wise", first="attn.qkv", second="attn.proj")
MLP_PLAN = PLAN.format(what="the MLP's pair, attention left whole", first="mlp.0", second="mlp.2")
STEPS = ["--max_steps", "4", "--warmup_steps", "1", "--log_every", "1", "--eval_every", "0"]


def vit_copy(folder, script: str, name: str | None = None, plan: str | None = None):
    """A copy of `script` (and common/, vit_shaped.py beside it) whose data section makes the synthetic
    regression and whose MODEL section builds the ViT-shaped model (vit_shaped.DATA, .MODEL), without the
    built-in data sets' and models' flags; `plan`: train_tp.py's model_tp_plan ends in it instead of the GPT's."""
    if not (folder / "common").is_dir():
        shutil.copytree(SCRIPTS / "common", folder / "common", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(REPO / "tests" / "vit_shaped.py", folder / "vit_shaped.py")
    lines = (SCRIPTS / script).read_text().splitlines(keepends=True)
    data = next(i for i, line in enumerate(lines) if line.startswith(DATA_MARKER))
    loader = next(i for i in range(data, len(lines)) if "train_loader = make_train_loader(" in lines[i])
    seed = next(i for i in range(loader, len(lines)) if lines[i].strip().startswith("set_seed(args.seed)"))
    built = next(i for i in range(seed, len(lines)) if "model, task = language_model(" in lines[i])
    text = "".join(
        [*lines[: data + 1], vit_shaped.DATA, *lines[loader : seed + 1], vit_shaped.MODEL, *lines[built + 1 :]]
    )
    text, n = re.subn(BUILTIN_FLAGS, "", text, flags=re.M)
    assert n == 1, f"{script}'s flags section: no add_builtin_flags lines to drop"
    if plan:
        text, n = re.subn(GPT_PLAN, plan, text, flags=re.M)
        assert n == 1, f"{script}'s model_tp_plan: no built-in GPT's plan to replace"
    (folder / (name or script)).write_text(text)
    return folder / (name or script)


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vit_copies")
    assert REPO not in folder.resolve().parents
    for script in ("train_ep.py", "train_tp.py", "train_ddp.py", "train_fsdp.py"):
        vit_copy(folder, script)
    vit_copy(folder, "train_tp.py", "train_tp_fused.py", FUSED_PLAN)
    vit_copy(folder, "train_tp.py", "train_tp_mlp.py", MLP_PLAN)
    return folder


def in_turn(copies, nproc: int, scripts: list[str]) -> dict:
    """Each copy's run, `nproc` processes, all in one launch -> {script: (result, its output folder)}."""
    outs = [copies / f"out{nproc}_{script.removesuffix('.py')}" for script in scripts]
    cases = [
        # global batch 16 on any number of processes: a TP group reads one batch
        [str(copies / s), [*STEPS, "--batch_size", str(16 if "_tp" in s else 16 // nproc), "--output_dir", str(o)]]
        for s, o in zip(scripts, outs, strict=True)
    ]
    results = run_in_turn(cases, nproc, copies / f"turn{nproc}", cwd=copies)
    return {s: (r, o) for s, r, o in zip(scripts, results, outs, strict=True)}


@pytest.fixture(scope="module")
def two_processes(copies) -> dict:
    scripts = ["train_ep.py", "train_tp.py", "train_tp_fused.py", "train_tp_mlp.py", "train_ddp.py", "train_fsdp.py"]
    return in_turn(copies, 2, scripts)


@pytest.fixture(scope="module")
def one_process(copies) -> dict:
    return in_turn(copies, 1, ["train_ep.py", "train_ddp.py", "train_fsdp.py"])


def assert_one_line_refusal(returncode: int, stderr: str, output_dir, *words: str) -> str:
    """Exit 2, one `error:` line holding `words`, no frame of a project file, nothing of a run written."""
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert returncode == 2 and len(errors) == 1, f"exit {returncode}, expected one error line:\n{stderr[-3000:]}"
    missing = [w for w in words if w not in errors[0]]
    assert not missing, f"the error line lacks {missing}: {errors[0]}"
    frames = re.findall(r'File "([^"]+)", line \d+', stderr)
    own = [f for f in frames if "/common/" in f or "/train_" in f or f.endswith("vit_shaped.py")]
    assert not own, f"a traceback through the project's files: {own}\n{stderr[-3000:]}"
    assert not (output_dir / "checkpoints").exists() and not (output_dir / "model").exists()
    return errors[0]


def trained(result: dict, output_dir) -> dict:
    assert result["returncode"] == 0, f"exit {result['returncode']}\n{result['stderr'][-3000:]}"
    assert (output_dir / "model" / "model.safetensors").is_file()
    return train_losses(output_dir)


@pytest.mark.parametrize("nproc", [1, 2])
def test_ep_on_a_model_without_experts_is_refused(nproc, one_process, two_processes):
    result, out = (one_process if nproc == 1 else two_processes)["train_ep.py"]
    line = assert_one_line_refusal(result["returncode"], result["stderr"], out, "finds none in ViTShaped")
    assert "experts_of" in line and "docs/ep.md" in line and "train_fsdp.py" in line
    assert "cut checked" not in result["stdout"], "refused after the cut check ran"


def test_tp_with_its_plan_not_written_is_refused(two_processes):
    result, out = two_processes["train_tp.py"]
    line = assert_one_line_refusal(result["returncode"], result["stderr"], out, "ViTShaped has none yet")
    assert "model_tp_plan" in line and "docs/tp.md" in line and "blocks.0" in line


def test_tp_cutting_a_fused_qkv_column_wise_is_refused_naming_the_entry(two_processes):
    result, out = two_processes["train_tp_fused.py"]
    line = assert_one_line_refusal(result["returncode"], result["stderr"], out, "'blocks.0.attn.qkv'")
    assert (
        "fused projection" in line
        and "Cut q, k and v into 3 layers" in line
        and "leave blocks.0.attn.qkv whole" in line
    )
    assert "model_tp_plan" in line and "docs/tp.md" in line


def test_the_fused_refusal_is_one_line_under_the_launcher(copies, two_processes):
    """The same refusal launched alone: the launcher's exit code, no frame of the project's files in its stderr
    (torchrun adds its own report of the failed child)."""
    out = copies / "out_alone"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_MULTI), "--num_processes"]
    cmd += ["2", "--main_process_port", str(free_port()), str(copies / "train_tp_fused.py"), *STEPS]
    result = run_cmd([*cmd, "--batch_size", "8", "--output_dir", str(out)], env=job_env(), cwd=copies)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if "error: the TP plan entry 'blocks.0.attn.qkv'" in line]
    assert errors, result.stderr[-3000:]
    frames = re.findall(r'File "([^"]+)", line \d+', result.stderr)
    assert not [f for f in frames if str(copies) in f], result.stderr[-3000:]
    assert not (out / "checkpoints").exists() and not (out / "model").exists()


def test_tp_leaving_the_fused_qkv_whole_trains_as_one_process(one_process, two_processes):
    reference = trained(*one_process["train_ddp.py"])
    assert_same_losses(reference, trained(*two_processes["train_tp_mlp.py"]), range(1, 5), tol=1e-5)


@pytest.mark.parametrize("script", ["train_ddp.py", "train_fsdp.py"])
def test_sequential_blocks_are_units_on_1_and_2_processes(script, one_process, two_processes):
    reference = trained(*one_process["train_ddp.py"])
    one, two = trained(*one_process[script]), trained(*two_processes[script])
    assert_same_losses(reference, one, range(1, 5), tol=1e-5)
    assert_same_losses(one, two, range(1, 5), tol=1e-5)


def test_a_sequential_that_is_no_container_of_units_is_still_refused_alike():
    """find_units: an empty nn.Sequential (or a module that is no container) is refused on any count."""
    model = nn.Module()
    model.blocks = nn.Sequential()
    with pytest.raises(UsageError, match="not a non-empty nn.ModuleDict, nn.ModuleList or nn.Sequential"):
        find_units(model, "blocks")
    model.blocks = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert list(find_units(model, "blocks")) == list(model.blocks)
