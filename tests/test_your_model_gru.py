"""docs/your-model-reference.md's worked example (issue 42): pytorch/examples' word_language_model RNNModel as a
GRU (the decoder tied to the embedding, time-major outputs, dropout), copied from train_ddp.py and train_fsdp.py
with the page's own rnn_lm.py and diffs, outside the repository.

- 2 processes match one process within 1e-5 per step (DDP, FSDP; fp32, DROPOUT = 0.0: each rank draws its own
  dropout masks);
- the in-run evaluation, whose ranks' last batches are padded and cut along Task.sample_dim, equals
  scripts/evaluate.py on the export; train_ddp.py's export holds the tied weight once (it crashed after training:
  safetensors refuses two names for one tensor), and every export reloads tied;
- before step 1, one line each: the outputs' samples declared on the wrong dimension (it crashed evaluation
  after training), an export that raises (the trial export), a TP plan that cuts a tied weight (it trained untied)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_your_model import code_blocks, run_copy

from conftest import CPU_MULTI, REPO, SCRIPTS, assert_same_losses, free_port, read_metrics

PAGE, PAGE_ZH = REPO / "docs" / "your-model-reference.md", REPO / "docs" / "zh" / "your-model-reference.md"
DIFF_LABEL = re.compile(r"--- gru/(\S+)\n\+\+\+ gru/(\S+)\n")
COPIES = ("train_ddp.py", "train_fsdp.py")
STEPS = 6
# 60 validation samples in batches of 16 per rank: every rank's last batch is padded (30 = 16 + 14 on 2 ranks)
FLAGS = ["--max_steps", str(STEPS), "--warmup_steps", "2", "--log_every", "1", "--eval_every", "3"]
FLAGS += ["--eval_batch_size", "16"]
GLOBAL_BATCH = 16
RUNS_GROUP = pytest.mark.xdist_group("gru_runs")  # the three runs (and the copy) made once, on one worker
SAMPLE_DIM = "    sample_dim = 1  # the outputs are (T, B, ntoken): evaluation cuts off its padding along dimension 1\n"


def page_module(path: Path = PAGE) -> str:
    found = [body for body in code_blocks(path, "python") if "class RNNLMTask(Task)" in body]
    assert len(found) == 1, f"{path.name}: expected one ```python block with class RNNLMTask, found {len(found)}"
    return found[0]


def page_diffs(path: Path = PAGE) -> dict[str, str]:
    """{script: diff} of the page's ```diff blocks labelled `--- gru/<script>`."""
    diffs = {}
    for body in code_blocks(path, "diff"):
        label = DIFF_LABEL.match(body)
        if label:
            assert label.group(1) == label.group(2), body[:200]
            diffs[label.group(1)] = body
    return diffs


@pytest.fixture(scope="module")
def copy(tmp_path_factory) -> Path:
    """The page's act: the two scripts, evaluate.py and common/ in one folder outside the repository, rnn_lm.py
    beside them with DROPOUT = 0.0 (so that 2 processes can match one), the page's diffs applied with patch -p1."""
    folder = tmp_path_factory.mktemp("gru") / "gru"
    folder.mkdir()
    assert REPO not in folder.resolve().parents
    shutil.copytree(SCRIPTS / "common", folder / "common", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(SCRIPTS / "evaluate.py", folder)
    module = page_module()
    assert "DROPOUT = 0.2" in module
    (folder / "rnn_lm.py").write_text(module.replace("DROPOUT = 0.2", "DROPOUT = 0.0"))
    diffs = page_diffs()
    assert set(diffs) == set(COPIES), f"the page should show one gru/ diff per script: {sorted(diffs)}"
    for script in COPIES:
        shutil.copy(SCRIPTS / script, folder / script)
        result = subprocess.run(
            ["patch", "-p1", "--fuzz=0", "--no-backup-if-mismatch"],
            cwd=folder,
            input=diffs[script],
            capture_output=True,
            text=True,
        )
        assert result.returncode == 0, (
            f"the page's gru/{script} diff no longer applies (python tests/your_model/update_page.py rewrites "
            f"it):\n{result.stdout}{result.stderr}"
        )
    return folder


def train(folder: Path, script: str, nproc: int, out: str) -> Path:
    args = [script, *FLAGS, "--batch_size", str(GLOBAL_BATCH // nproc), "--output_dir", out]
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_MULTI)]
    ports = ["--num_processes", str(nproc), "--main_process_port", str(free_port())]
    cmd = [sys.executable, *args] if nproc == 1 else [*launcher, *ports, *args]
    result = run_copy(folder, cmd)
    assert result.returncode == 0, f"exit {result.returncode}: {' '.join(cmd)}\n{result.stderr[-5000:]}"
    return folder / out


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run) if r["type"] == "train"}


def test_the_page_shows_the_example_in_both_editions():
    assert set(page_diffs()) == set(COPIES)
    assert page_diffs(PAGE_ZH) == page_diffs() and page_module(PAGE_ZH) == page_module()
    module = page_module()
    assert "self.decoder.weight = self.encoder.weight" in module and SAMPLE_DIM in module
    assert "nn.GRU(" in module and "DROPOUT = 0.2" in module


@pytest.fixture(scope="module")
def runs(copy) -> dict[str, Path]:
    return {
        "one": train(copy, "train_ddp.py", 1, "runs/one"),
        "ddp": train(copy, "train_ddp.py", 2, "runs/ddp"),
        "fsdp": train(copy, "train_fsdp.py", 2, "runs/fsdp"),
    }


@RUNS_GROUP
@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_two_processes_match_one(runs, name):
    reference, run = losses(runs["one"]), losses(runs[name])
    assert_same_losses(reference, run, range(1, STEPS + 1), tol=1e-5)
    print(f"{name} on 2 processes: max |loss - one process| {max(abs(reference[s] - run[s]) for s in reference):.1e}")


@RUNS_GROUP
@pytest.mark.parametrize("name", ["one", "ddp", "fsdp"])
def test_evaluate_reproduces_the_run_and_the_tie_survives(copy, runs, name):
    """The export used to crash (safetensors: "Some tensors share memory"); the in-run evaluation cuts each
    rank's padded last batch along sample_dim = 1; evaluate.py (its Task from model/task.json) repeats it."""
    run = runs[name]
    in_run = [r for r in read_metrics(run) if r["type"] == "eval"][-1]
    assert in_run["step"] == STEPS and in_run["num_samples"] == 60, in_run
    result = run_copy(copy, [sys.executable, "evaluate.py", "--model_dir", str(run / "model")])
    assert result.returncode == 0, result.stderr[-3000:]
    exported = json.loads(result.stdout.strip().splitlines()[-1])
    assert exported["num_samples"] == 60
    assert exported["eval_loss"] == pytest.approx(in_run["eval_loss"], abs=1e-6), (exported, in_run)
    check_tie = (
        "import json, sys, torch; from pathlib import Path; from safetensors import safe_open;"
        "from common.exported import load_own_model;"
        "f = safe_open(sys.argv[1] + '/model.safetensors', 'pt'); keys, meta = sorted(f.keys()), f.metadata();"
        "model, _ = load_own_model(Path(sys.argv[1]), 'rnn_lm.py:RNNLMTask', 'test');"
        "equal = len(keys) == 10 or torch.equal(f.get_tensor('encoder.weight'), f.get_tensor('decoder.weight'));"
        "print(json.dumps({'keys': keys, 'meta': meta, 'tied': model.decoder.weight is model.encoder.weight,"
        "'equal': equal}))"
    )
    result = run_copy(copy, [sys.executable, "-c", check_tie, str(run / "model")])
    assert result.returncode == 0, result.stderr[-3000:]
    saved = json.loads(result.stdout.strip().splitlines()[-1])
    assert saved["tied"], saved
    if name != "fsdp":  # one tensor in the state dict: written once, the tie recorded (it crashed safetensors)
        assert "encoder.weight" in saved["keys"] and "decoder.weight" not in saved["keys"], saved
        assert json.loads(saved["meta"]["tied"]) == {"decoder.weight": "encoder.weight"}, saved
    else:  # gathered from shards, name by name: two equal tensors, written both (build_model ties them again)
        assert {"encoder.weight", "decoder.weight"} <= set(saved["keys"]) and saved["equal"], saved


BROKEN = {  # (what is replaced in rnn_lm.py, by what, the start of its one error line)
    "sample_dim": (SAMPLE_DIM, "", "error: Task.eval_sums raised ValueError on 2 samples cut from 4 validation"),
    "export": (
        "    # scripts/evaluate.py --task",
        "    def export(self, state_dict, model_dir, data_source):\n"
        "        raise OSError('[Errno 28] No space left on device')\n\n    # scripts/evaluate.py --task",
        "error: a trial export before step 1 (Task.export of the model as built, into a temporary folder) raised "
        "OSError: [Errno 28] No space left on device",
    ),
}


@pytest.mark.parametrize("mistake, nproc", [("sample_dim", 1), ("export", 1), ("export", 2)])
def test_what_would_fail_after_training_is_one_line_before_step_1(copy, tmp_path, mistake, nproc):
    """On 2 processes the trial export fails on the main one only: every rank stops with the same line."""
    old, new, expected = BROKEN[mistake]
    folder = tmp_path / "broken"
    shutil.copytree(copy, folder, ignore=shutil.ignore_patterns("runs", "__pycache__"))
    module = (folder / "rnn_lm.py").read_text()
    assert old in module, f"the page's rnn_lm.py no longer holds {old!r}"
    (folder / "rnn_lm.py").write_text(module.replace(old, new))
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_MULTI)]
    ports = ["--num_processes", str(nproc), "--main_process_port", str(free_port())]
    cmd = [sys.executable] if nproc == 1 else [*launcher, *ports]
    result = run_copy(folder, [*cmd, "train_ddp.py", *FLAGS, "--output_dir", "runs/broken"], timeout=120)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and len(set(errors)) == 1, f"exit {result.returncode}\n{result.stderr[-3000:]}"
    assert nproc > 1 or (result.returncode == 2 and len(errors) == 1), f"exit {result.returncode}"
    assert errors[0].startswith(expected), errors[0]
    assert not (folder / "runs" / "broken" / "metrics.jsonl").exists()
    assert nproc > 1 or "Traceback" not in result.stderr  # the launcher's own report of a rank's exit 2 aside
    if mistake == "sample_dim":
        assert errors[0].removeprefix("error: ") in PAGE.read_text(encoding="utf-8"), "the page should show the line"


def test_a_tp_plan_that_cuts_a_tied_weight_is_refused(copy):
    """train_tp.py's apply_tensor_parallel (train_hybrid.py's too) refuses before parallelize_module, which gave
    the decoder a parameter of its own: the run trained untied, 6.5e-4 off. Left whole, the tie is kept."""
    probe = f"""
import sys
sys.path[:0] = [{str(SCRIPTS)!r}]
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from common.errors import UsageError
from rnn_lm import RNNModel
from train_tp import apply_tensor_parallel
decoder = ColwiseParallel(output_layouts=Replicate())
for plan in ({{"decoder": decoder}}, {{"encoder": RowwiseParallel(), "decoder": decoder}}):
    try:
        apply_tensor_parallel(RNNModel(), None, plan)  # refused before the mesh is needed
    except UsageError as e:
        print(e)
"""
    result = run_copy(copy, [sys.executable, "-c", probe])
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 2, result.stdout
    assert lines[0].startswith("the TP plan cuts decoder.weight (ColwiseParallel) but not encoder.weight, one "), lines
    assert lines[1].startswith("the TP plan cuts encoder.weight (RowwiseParallel) and decoder.weight"), lines
    assert all("leave " in line and "out of the plan" in line for line in lines)


# ----------------------------------------------------------------------------- the ground floor, directly
def test_samples_on_the_wrong_dimension_are_one_line_even_where_the_shapes_fit():
    """Rows of 4 tokens and a probe of 4 samples: a time-major model's outputs cut along dimension 0 have the
    shape the targets want, and eval_sums returns a number; the contract check compares it with the 2 samples
    run alone, and the declaration decides."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    sys.path.insert(0, str(SCRIPTS))
    from common.contract_check import check_task_contract
    from common.errors import UsageError
    from common.task import Task

    class TimeMajorTask(Task):
        units_path = None

        def inputs(self, batch):
            return (batch[0].t(),)

        def targets(self, batch):
            return batch[1]

        def count_targets(self, batch):
            return batch[1].numel()

        def loss(self, outputs, targets):
            return F.cross_entropy(outputs.flatten(0, 1), targets.t().flatten(), reduction="sum"), targets.numel()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16))
    rows = torch.randint(16, (8, 5))
    validation = TensorDataset(rows[:, :-1], rows[:, 1:])
    with pytest.raises(UsageError, match=r"evaluation cuts the outputs' samples along dimension 0 \(Task.sample_dim\)"):
        check_task_contract(TimeMajorTask(), model, validation, "cpu")
    TimeMajorTask.sample_dim = 1
    check_task_contract(TimeMajorTask(), model, validation, "cpu")


def test_a_tied_hf_model_passes_the_trial_export_and_round_trips(tmp_path):
    """The 🤗 export (save_pretrained) keeps its own ties: a tiny Llama with tie_word_embeddings goes through the
    trial export before step 1 in well under a second, and its export loads back tied, with the same logits."""
    import time

    import torch
    from test_hf_model import BASE, SEQ, flags
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from common.contract_check import trial_export
    from common.hf import load_hf_model

    folder = tmp_path / "tied"
    LlamaForCausalLM(LlamaConfig(**{**BASE, "vocab_size": 256, "tie_word_embeddings": True})).save_pretrained(folder)
    model, task = load_hf_model(flags(model_name_or_path=str(folder)), SEQ, "text")
    start = time.perf_counter()
    trial_export(task, model)
    seconds = time.perf_counter() - start
    print(f"trial export of a tied tiny Llama: {seconds * 1000:.0f} ms")
    assert seconds < 5
    task.export(model.state_dict(), tmp_path / "model", {})
    loaded, ids = AutoModelForCausalLM.from_pretrained(tmp_path / "model"), torch.randint(256, (2, SEQ))
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
