"""scripts/evaluate.py on a model of your own (docs/your-model.md, "Evaluating your model with evaluate.py").

A Task of the user's own, in a file outside the repository, rebuilds its model (Task.build_model(config)) and
gives its validation split (Task.validation_data()). The model folder is written by export_model, as a training
script writes it, so it records where the Task lives (model/task.json). evaluate.py on 1 process (given --task)
and on 2 (without --task: task.json says) must give the eval_loss computed here directly, within 1e-6, over each
of the split's samples once (an odd number, so the 2 processes hold unequal shares). The contract's mistakes are
refused with one `error:` line each, before any process group exists."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import REPO, SCRIPTS, launch, run_refused

sys.path.insert(0, str(SCRIPTS))
from common.checkpoint import export_model

N_VALIDATION = 101  # odd: on 2 processes the shares are 51 and 50, the last batch padded
USER_FILE = '''
"""A model of one's own and its Task, with the two methods evaluate.py needs."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from common.task import Task


def make_data():
    g = torch.Generator().manual_seed(0)  # the same samples on every process
    x = torch.randn(300, 16, generator=g)
    y = torch.sin(x[:, :8]).sum(1, keepdim=True) + 0.1 * torch.randn(300, 1, generator=g)
    return TensorDataset(x[:199], y[:199]), TensorDataset(x[199:], y[199:])


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(F.relu(self.fc1(x)))


class RegMLP(nn.Module):
    def __init__(self, width=32, n_layers=2):
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(n_layers))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class RegressionTask(Task):
    name = "regression"
    units_path = "layers"

    def __init__(self, width=32):
        self.width = width

    def inputs(self, batch):
        return (batch[0],)

    def targets(self, batch):
        return batch[1]

    def count_targets(self, batch):
        return batch[1].numel()

    def loss(self, outputs, targets):
        return F.mse_loss(outputs.float(), targets, reduction="sum"), targets.numel()

    def eval_sums(self, outputs, targets):
        error = outputs.float() - targets
        return {"loss": error.pow(2).sum(), "targets": targets.numel(), "abs_error": error.abs().sum()}

    def eval_metrics(self, sums):
        return {"eval_loss": sums["loss"] / sums["targets"], "mae": sums["abs_error"] / sums["targets"]}

    def config(self):
        return {"task": self.name, "width": self.width}

    # ---- what evaluate.py needs
    def build_model(self, config):
        return RegMLP(config["width"])

    def validation_data(self):
        return make_data()[1]


class WrongWidthTask(RegressionTask):
    def build_model(self, config):
        return RegMLP(2 * config["width"])


class NoBuildTask(Task):
    def validation_data(self):
        return make_data()[1]


class NotATask:
    pass
'''


def import_user_file(path: Path):
    spec = importlib.util.spec_from_file_location("own_task_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import in a training script leaves it: inspect finds its file there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def own_model(tmp_path_factory):
    """The user's file (outside the repository), a model folder exported from it, and the eval_loss and mae
    of that model on its validation split, computed directly."""
    root = tmp_path_factory.mktemp("own_model")
    assert REPO not in root.resolve().parents
    user_file = root / "own_task.py"
    user_file.write_text(USER_FILE)
    module = import_user_file(user_file)
    torch.manual_seed(0)
    task = module.RegressionTask()
    model = task.build_model(task.config())
    with torch.no_grad():  # not a freshly initialised model: the head's output is not near 0
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    one_process = SimpleNamespace(is_main_process=True, wait_for_everyone=lambda: None)
    export_model(one_process, model, task, {}, root / "model")  # what a training script's save does
    x, y = task.validation_data().tensors
    with torch.no_grad():
        error = (model(x) - y).double()
    return SimpleNamespace(
        root=root,
        file=user_file,
        model_dir=root / "model",
        eval_loss=float(error.pow(2).mean()),
        mae=float(error.abs().mean()),
    )


def test_the_export_records_where_its_task_lives(own_model):
    recorded = json.loads((own_model.model_dir / "task.json").read_text())
    assert recorded == {"file": str(own_model.file.resolve()), "class": "RegressionTask"}


@pytest.mark.parametrize("nproc", [1, 2])
def test_evaluate_scores_each_sample_once(own_model, nproc, tmp_path):
    """1 process given --task; 2 processes without it (the export's task.json names the Task)."""
    out = tmp_path / "eval.json"
    task_flag = ["--task", f"{own_model.file}:RegressionTask"] if nproc == 1 else []
    flags = ["--model_dir", str(own_model.model_dir), *task_flag, "--batch_size", "16", "--output_file", str(out)]
    launch("evaluate.py", flags, nproc=nproc, timeout=180)
    result = json.loads(out.read_text())
    assert result["num_samples"] == N_VALIDATION, result
    assert abs(result["eval_loss"] - own_model.eval_loss) < 1e-6, (result, own_model.eval_loss)
    assert abs(result["mae"] - own_model.mae) < 1e-6, (result, own_model.mae)


REFUSED = {
    "no_file": (
        ["--task", "nowhere/own_task.py:RegressionTask"],
        ["--task nowhere/own_task.py:RegressionTask", "there is no file"],
    ),
    "no_class": (["--task", "{file}:Regression"], ["has no class 'Regression'", "its Task subclasses: RegressionTask"]),
    "not_a_task": (["--task", "{file}:NotATask"], ["NotATask is a class, not a subclass of common.task.Task"]),
    "no_build_model": (["--task", "{file}:NoBuildTask"], ["NoBuildTask has no build_model(config)", "def build_model"]),
    "state_dict": (
        ["--task", "{file}:WrongWidthTask"],
        [
            "model.safetensors does not fit the model",
            "first difference: inp.weight: [32, 16] in model.safetensors, [64, 16]",
        ],
    ),
    "no_task_json": ([], ["no task.json says which Task wrote it", "pass --task FILE.py:Class"]),
    "data_flag": (
        ["--dataset", "addition"],
        ["--dataset: a model of your own is scored on its Task's validation_data()"],
    ),
}


@pytest.fixture(scope="module")
def refused(own_model):
    """Each REFUSED case as `python scripts/evaluate.py --model_dir ...`, all in one interpreter."""
    bare = own_model.root / "model_without_task_json"  # a folder exported before task.json, or copied without it
    if not bare.exists():
        bare.mkdir()
        for name in ("model.safetensors", "config.json", "data.json"):
            (bare / name).write_bytes((own_model.model_dir / name).read_bytes())
    cases = []
    for name, (flags, _) in REFUSED.items():
        model_dir = bare if name == "no_task_json" else own_model.model_dir
        cases.append(("evaluate.py", ["--model_dir", model_dir, *(f.format(file=own_model.file) for f in flags)]))
    return dict(zip(REFUSED, run_refused(cases), strict=True))


@pytest.mark.xdist_group("evaluate_own_model_refused")
@pytest.mark.parametrize("name", list(REFUSED))
def test_a_broken_contract_is_one_line(refused, name):
    result = refused[name]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    for needle in REFUSED[name][1]:
        assert needle in errors[0], errors[0]
