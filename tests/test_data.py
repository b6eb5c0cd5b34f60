"""The data module: built-in sets, local files and hub-style folders through one load_dataset path."""

import argparse
import csv
import hashlib
import json
import sys
import threading
import time

import pytest
import torch
from accelerate import PartialState

from conftest import REPO, TINY, free_port, launch, read_metrics

sys.path.insert(0, str(REPO / "scripts"))
import common.data
from common.builtin_flags import add_data_args
from common.data import build_addition, first_samples, hub_unreachable, load_data
from common.errors import UsageError

TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n\n" for i in range(200))


def data_args(cache, *flags):
    parser = argparse.ArgumentParser()
    add_data_args(parser)
    return parser.parse_args(["--data_cache_dir", str(cache), *flags])


@pytest.fixture(scope="module")
def state():
    return PartialState(cpu=True)


def test_addition_is_deterministic_disjoint_and_masked(tmp_path, state):
    files = build_addition(tmp_path / "a", 3)
    again = build_addition(tmp_path / "b", 3)
    for split in files:
        assert hashlib.sha256(files[split].read_bytes()).digest() == hashlib.sha256(again[split].read_bytes()).digest()
    train = {json.loads(line)["text"] for line in files["train"].read_text().splitlines()}
    val = {json.loads(line)["text"] for line in files["validation"].read_text().splitlines()}
    assert len(train) == 100_000 and len(val) == 1_000 and not train & val
    for text in list(val)[:50]:
        prompt, answer = text.split("=")
        a, b = prompt.split("+")
        assert len(a) == len(b) == 3 and int(answer.strip()[::-1]) == int(a) + int(b)

    data = load_data(data_args(tmp_path / "a"), state, block_size=64)
    assert data.task == "addition" and data.seq_len == 13 and len(data.validation) == 1000
    assert data.name == "addition"
    row = data.validation[0]
    text = bytes(row["input_ids"][row["input_ids"] != 0].tolist()).decode()
    targets = bytes(row["labels"][row["labels"] != -100].tolist()).decode()
    assert text.endswith(targets) and targets.endswith("\n") and "=" not in targets
    counts = {int((data.validation[i]["labels"] != -100).sum()) for i in range(len(data.validation))}
    assert {4, 5} <= counts <= {2, 3, 4, 5}, "answers of 1 to 4 digits (+ newline): unequal target counts"


def test_max_eval_samples_keeps_the_first_rows(tmp_path, state, monkeypatch):
    """--max_eval_samples N: the validation split's first N rows, as tensors or a 🤗 dataset; the train split
    whole; a split of your own (evaluate.py on your model) cut the same way; more than there are: all."""
    whole = load_data(data_args(tmp_path / "cache"), state, block_size=64)
    first = load_data(data_args(tmp_path / "cache", "--max_eval_samples", "10"), state, block_size=64)
    monkeypatch.setattr(common.data, "IN_MEMORY_MAX_TOKENS", 0)
    mapped = load_data(data_args(tmp_path / "cache", "--max_eval_samples", "10"), state, block_size=64)
    assert len(first.validation) == len(mapped.validation) == 10 and len(first.train) == len(whole.train)
    for i in (0, 9):
        assert (first.validation[i]["input_ids"] == whole.validation[i]["input_ids"]).all()
        assert (mapped.validation[i]["labels"] == whole.validation[i]["labels"]).all()
    own = torch.utils.data.TensorDataset(torch.arange(5))
    assert [int(x) for (x,) in first_samples(own, 3)] == [0, 1, 2] and first_samples(own, 9) is own


@pytest.mark.parametrize("suffix", [".txt", ".jsonl", ".csv"])
def test_local_files_pack_the_same_bytes(tmp_path, state, suffix):
    docs = TEXT.split("\n\n")
    train, val = tmp_path / f"train{suffix}", tmp_path / f"val{suffix}"
    for path, part in ((train, docs[:150]), (val, docs[150:])):
        if suffix == ".txt":
            path.write_text("\n".join(part) + "\n")
        elif suffix == ".jsonl":
            path.write_text("".join(json.dumps({"content": d}) + "\n" for d in part))
        else:
            with open(path, "w", newline="") as f:
                writer = csv.writer(f)
                writer.writerow(["content"])
                writer.writerows([d] for d in part)
    column = [] if suffix == ".txt" else ["--text_column", "content"]
    data = load_data(
        data_args(tmp_path / "cache", "--train_file", str(train), "--validation_file", str(val), *column),
        state,
        block_size=32,
    )
    assert data.task == "text" and data.seq_len == 32 and data.name == f"train{suffix}"
    assert len(data.train) > 10 and len(data.validation) > 2
    first = bytes(data.train[0]["input_ids"].tolist()).decode()
    assert first == "def f0(x):\n    return x * 0 + 0\ndef f1(x):"[:32], "every format gives the same byte stream"
    assert (data.train[0]["labels"] == data.train[0]["input_ids"]).all(), "packed text: every byte is a target"


def test_hub_style_folder_and_held_out_validation(tmp_path, state):
    folder = tmp_path / "my_dataset"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in TEXT.split("\n\n")[:150]))
    (folder / "validation.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in TEXT.split("\n\n")[150:]))
    data = load_data(data_args(tmp_path / "cache", "--dataset_name", str(folder)), state, block_size=32)
    assert len(data.train) > 10 and len(data.validation) > 2 and data.name == str(folder)

    only_train = tmp_path / "only_train.txt"
    only_train.write_text(TEXT)
    data = load_data(data_args(tmp_path / "cache", "--train_file", str(only_train)), state, block_size=32)
    assert len(data.validation) >= 1 and len(data.train) > 10 * len(data.validation) // 2


def test_missing_hub_dataset_is_one_clear_error(tmp_path, state):
    with pytest.raises(UsageError, match="could not load --dataset_name"):
        load_data(data_args(tmp_path / "cache", "--dataset_name", str(tmp_path / "nowhere")), state, block_size=32)
    with pytest.raises(UsageError, match="--text_column 'body' not found"):
        text = tmp_path / "t.jsonl"
        text.write_text(json.dumps({"text": "x" * 100}) + "\n")
        load_data(
            data_args(
                tmp_path / "cache", "--train_file", str(text), "--validation_file", str(text), "--text_column", "body"
            ),
            state,
            block_size=8,
        )


def test_pystdlib_builds_from_this_python(tmp_path, state):
    data = load_data(data_args(tmp_path / "cache", "--dataset", "pystdlib"), state, block_size=128)
    assert data.task == "text" and len(data.train) > 10_000 and len(data.validation) > 500
    assert data.name == "pystdlib", "scripts print data.name: 'text' is the task, not the data set"


@pytest.mark.parametrize("endpoint", ["closed_port", "huggingface.co"])
def test_unreachable_hub_fails_at_once_naming_the_fixes(tmp_path, state, monkeypatch, endpoint):
    """No network: one line naming the fixes within seconds, not datasets' ~25 s of retries and a bare error."""
    import datasets

    if endpoint == "closed_port":  # nothing listens there: unreachable on any machine
        monkeypatch.setattr(datasets.config, "HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    elif hub_unreachable(datasets.config.HF_ENDPOINT) is None:
        pytest.skip("the hub is reachable from this machine")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)  # what a user without HF_HUB_OFFLINE=1 has
    start = time.monotonic()
    with pytest.raises(UsageError, match="--dataset_name karpathy/tiny_shakespeare: no such local folder") as error:
        load_data(data_args(tmp_path / "cache", "--dataset_name", "karpathy/tiny_shakespeare"), state, block_size=32)
    assert time.monotonic() - start < 10
    message = str(error.value)
    assert "\n" not in message and "cannot be reached" in message
    assert all(fix in message for fix in ("HF_HUB_OFFLINE=1", "local folder as --dataset_name", "--train_file")), (
        message
    )


def test_hub_check_is_bounded_when_nothing_answers(monkeypatch):
    """A connection (or name lookup) that hangs counts as unreachable after the timeout."""
    release = threading.Event()

    def hang(*args, **kwargs):
        release.wait(30)
        raise OSError("released")

    monkeypatch.setattr(common.data.socket, "create_connection", hang)
    start = time.monotonic()
    try:
        assert hub_unreachable("https://huggingface.co", timeout=0.5) == "no connection within 0.5 s"
        assert time.monotonic() - start < 5
    finally:
        release.set()


def test_large_splits_stay_memory_mapped(tmp_path, state, monkeypatch):
    """Small splits are read into tensors; large ones stay 🤗 datasets: both give the same rows."""
    small = load_data(data_args(tmp_path / "cache"), state, block_size=64)
    monkeypatch.setattr(common.data, "IN_MEMORY_MAX_TOKENS", 0)
    large = load_data(data_args(tmp_path / "cache"), state, block_size=64)
    assert type(small.train).__name__ == "TensorRows" and type(large.train).__name__ == "Dataset"
    for i in (0, 7, len(large.validation) - 1):
        for column in ("input_ids", "labels"):
            assert (small.validation[i][column] == large.validation[i][column]).all()
            assert small.validation[i][column].dtype == large.validation[i][column].dtype == common.data.torch.int64


def test_text_training_on_two_processes_reports_perplexity(tmp_path, data_cache):
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"text": d}) + "\n" for d in TEXT.split("\n\n")))
    out = tmp_path / "run"
    flags = [*TINY, "--train_file", str(train), "--block_size", "32", "--batch_size", "4", "--max_steps", "6"]
    flags += ["--data_cache_dir", data_cache, "--report_to", "tensorboard", "--output_dir", str(out)]
    launch("train_ddp.py", flags, nproc=2)
    evals = [r for r in read_metrics(out) if r["type"] == "eval"]
    assert evals and "perplexity" in evals[-1] and "exact_match" not in evals[-1]
    assert list(out.rglob("events.out.tfevents.*")), "--report_to tensorboard wrote no event file"

    # evaluate.py: naming another data set replaces the model's (its --train_file no longer applies)
    result = tmp_path / "addition.json"
    flags = ["--model_dir", str(out / "model"), "--dataset", "addition", "--data_cache_dir", data_cache]
    launch("evaluate.py", [*flags, "--output_file", str(result)])
    assert json.loads(result.read_text()).keys() >= {"exact_match", "num_samples"}
