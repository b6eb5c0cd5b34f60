"""A run's own files kept safe (issue 42, item 7): trainer_state.json covered by the integrity check, one run
at a time in an --output_dir (a lock, taken over from a killed run), a full disk or a read-only folder as one
line, bad data files named, resumes with other data-shaping flags refused, local_nodes.py's bad commands."""

import argparse
import fcntl
import json
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from test_bad_input import assert_refused, tree_digest

from conftest import REPO, TINY, launch_tiny, run_cmd, run_refused

sys.path.insert(0, str(REPO / "scripts"))
from common.builtin_flags import add_data_args
from common.errors import UsageError

# one pytest-xdist worker for the module: its tests share two launched runs (the `runs` fixture)
pytestmark = pytest.mark.xdist_group("run_safety")

DOCUMENTS = [f"def f{i}(x):\n    return x * {i} + {i * i}\n" * (1 + i % 3) for i in range(400)]
RUN = ["--max_steps", "4", "--checkpoint_every", "2", "--keep_last", "0"]
OVERLAP = ["--outer_optimizer", "nesterov", "--sync_every", "2", "--overlap_steps", "1", "--checkpoint_every", "2"]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    """A --document_mask run on a .jsonl file (checkpoints at steps 2 and 4), and a DiLoCo run with overlapped
    fusions (a checkpoint at step 2): {"ddp": (its folder, its data flags), "diloco": ...}."""
    root = tmp_path_factory.mktemp("run_safety")
    data = ["--train_file", str(write_jsonl(root / "docs.jsonl", [{"text": t} for t in DOCUMENTS]))]
    data += ["--document_mask"]
    launch_tiny("train_ddp.py", root / "ddp", data_cache, *RUN, *data)
    launch_tiny("train_localsgd.py", root / "diloco", data_cache, "--max_steps", "2", *OVERLAP)
    return {"ddp": (root / "ddp", data), "diloco": (root / "diloco", [])}


def edit_state(run: Path, **changes) -> None:
    """Edit checkpoints/step_4/trainer_state.json by hand, its recorded digest left as it was."""
    file = run / "checkpoints" / "step_4" / "trainer_state.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}, indent=1))


@contextmanager
def lock_held_by_another_run(run: Path):
    """OUTPUT_DIR/.run.lock locked (flock) by this test process, as a run that is still going holds it."""
    fd = os.open(run / ".run.lock", os.O_RDWR | os.O_CREAT)
    os.write(fd, json.dumps({"host": "node7", "pid": 4242, "started": "2026-01-01 00:00:00"}).encode())
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        os.close(fd)


@pytest.fixture(scope="module")
def refused(runs, tmp_path_factory, data_cache):
    """Copies of the runs, each damaged or locked, resumed in one interpreter: name -> (result, copy, digest
    before, digest after)."""
    root = tmp_path_factory.mktemp("run_safety_refused")
    resume = ["--max_steps", "6", "--resume_from_checkpoint", "latest", "--data_cache_dir", data_cache]
    cases = {  # name -> (the run copied, its damage, the flags changed or dropped)
        "position": ("ddp", {"samples_in_epoch": 17}, []),
        "position_again": ("ddp", None, []),  # the same copy again: the refused run released its lock
        "position_huge": ("ddp", {"samples_in_epoch": 10**9}, []),
        "step": ("ddp", {"step": 3}, []),
        "no_document_mask": ("ddp", {}, ["--document_mask"]),
        "held": ("ddp", "held", []),
        "stale": ("ddp", "stale", []),
        "overlap_mix": ("diloco", {}, ["--overlap_mix", "0.25"]),
        "model_missing": ("ddp", "model_missing", []),  # last: it runs to its end (no step), writing model/
    }
    specs, copies = [], {}
    for name, (source, damage, flags) in cases.items():
        run, data = runs[source]
        copy = copies["position"] if name == "position_again" else root / name
        if name != "position_again":
            shutil.copytree(run, copy)
        if isinstance(damage, dict) and damage:
            edit_state(copy, **damage)
        if damage == "stale":  # a run killed without releasing its lock: the file is there, nobody holds it
            (copy / ".run.lock").write_text(json.dumps({"host": "vm0", "pid": 4243, "started": "2026-01-01 01:00"}))
        if damage == "model_missing":  # trained to step 4, its export failed (a full disk): no model/
            shutil.rmtree(copy / "model")
        copies[name] = copy
        script = "train_ddp.py" if source == "ddp" else "train_localsgd.py"
        args = [*TINY, *(OVERLAP if source == "diloco" else []), *resume, "--output_dir", copy]
        if name == "no_document_mask":
            args += [flag for flag in data if flag != "--document_mask"]
        else:
            args += [*data, *flags]
        if name in ("stale", "model_missing"):  # already at --max_steps 4: nothing to train
            args[args.index("6")] = "4"
        specs.append((name, script, args))
    before = {name: tree_digest(copies[name]) for name in cases}
    with lock_held_by_another_run(copies["held"]):
        before["held"] = tree_digest(copies["held"])
        results = run_refused([(script, args) for _, script, args in specs])
        after_held = tree_digest(copies["held"])
    out = {}
    for (name, _, _), result in zip(specs, results, strict=True):
        after = after_held if name == "held" else tree_digest(copies[name])
        out[name] = (result, copies[name], before[name], after)
    return out


def assert_refused_untouched(refused: dict, name: str, *needles: str) -> None:
    result, _, before, after = refused[name]
    assert_refused(result, *needles)
    assert after == before, f"{name}: the refused run changed its folder"


@pytest.mark.parametrize("name", ["position", "position_huge", "step"])
def test_an_edited_trainer_state_is_refused(refused, name):
    """trainer_state.json with another data position (1536 -> 17 or 10^9 in the issue) or step (which then
    wrote over the next checkpoint): its digest no longer matches; one line naming it and the way out."""
    checkpoints = refused[name][1] / "checkpoints"
    assert_refused_untouched(
        refused,
        name,
        f"--resume_from_checkpoint {checkpoints / 'step_4'}: trainer_state.json is damaged",
        f"resume from an earlier checkpoint (--resume_from_checkpoint {checkpoints / 'step_2'})",
        "start over",
    )


def test_a_refused_run_releases_its_lock(refused):
    """The same refused resume again, in the same interpreter: refused the same way, not as a run in progress."""
    assert_refused_untouched(refused, "position_again", "trainer_state.json is damaged")
    assert not (refused["position_again"][1] / ".run.lock").exists()


def test_resume_without_the_document_mask_is_refused(refused):
    assert_refused_untouched(
        refused, "no_document_mask", "saved with --document_mask, this run has no --document_mask", "same flags"
    )


def test_resume_with_another_overlap_mix_is_refused(refused):
    assert_refused_untouched(refused, "overlap_mix", "saved with --overlap_mix 0.5")


def test_a_second_run_in_the_same_output_dir_is_refused(refused):
    assert_refused_untouched(
        refused, "held", "is in use by another run (host node7, pid 4242, started 2026-01-01 00:00:00)"
    )


def test_a_killed_runs_lock_is_taken_over_and_said(refused):
    result, run, _, _ = refused["stale"]
    assert result.returncode == 0, result.stderr[-3000:]
    line = f"--output_dir {run}: taking over the lock of a run that ended without releasing it (host vm0, pid 4243"
    assert line in result.stdout
    assert "nothing to do" in result.stdout
    assert not (run / ".run.lock").exists(), "the lock is released at the run's end"


def test_a_finished_run_without_its_model_writes_it_from_the_last_checkpoint(refused):
    """What the line of a failed export says: the checkpoint at --max_steps resumes, trains no step, writes model/."""
    result, run, _, _ = refused["model_missing"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{run / 'model'} is missing: writing it from {run / 'checkpoints' / 'step_4'} (no step to train)" in (
        result.stdout
    )
    assert (run / "model" / "model.safetensors").is_file() and (run / "model" / "config.json").is_file()
    summary = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["type"] == "summary"]
    assert summary[-1]["steps"] == 0 and summary[-1]["final_step"] == 4, summary[-1]


def test_a_held_lock_refuses_every_rank_of_a_two_process_run(runs, tmp_path, data_cache):
    """Only the main process locks; the others learn its answer and stop with it, none left waiting."""
    run, data = runs["ddp"]
    shutil.copytree(run, tmp_path / "run")
    with lock_held_by_another_run(tmp_path / "run"):
        flags = [*data, "--max_steps", "6", "--resume_from_checkpoint", "latest"]
        result = launch_tiny("train_ddp.py", tmp_path / "run", data_cache, *flags, nproc=2, check=False, timeout=120)
    assert_refused(result, f"--output_dir {tmp_path / 'run'} is in use by another run (host node7, pid 4242")


def test_sync_batchnorm_is_recorded_and_checked_where_the_model_has_batchnorm(tmp_path):
    from common.checkpoint import data_flags_of
    from common.resume_checks import check_same_data_flags

    args = argparse.Namespace(document_mask=False, sync_batchnorm=True)
    with_bn = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    assert data_flags_of(args, with_bn) == {"document_mask": False, "sync_batchnorm": True}
    assert data_flags_of(args, torch.nn.Linear(2, 2)) == {"document_mask": False}  # nothing it would change
    with pytest.raises(UsageError, match="saved with --sync_batchnorm, this run has no --sync_batchnorm"):
        check_same_data_flags({"data_flags": {"sync_batchnorm": True}}, tmp_path, {"sync_batchnorm": False})
    check_same_data_flags({}, tmp_path, {"sync_batchnorm": False})  # an older checkpoint records none


# ---------------------------------------------------------------- a small file system of the test's own
@contextmanager
def tmpfs(folder: Path, size: str, read_only: bool = False):
    """A tmpfs of `size` mounted at `folder` (root: here and in CI), unmounted at the end."""
    folder.mkdir(parents=True, exist_ok=True)
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.decode().strip()}")
    try:
        if read_only:
            (folder / "run").mkdir()
            subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def test_a_full_disk_during_a_save_is_one_line_and_leaves_no_partial_save(tmp_path, data_cache):
    """4 MiB hold one tiny checkpoint (2.5 MB), not two: the save of step 2 fails; the line names the last
    complete checkpoint, the partial save is gone, step_1 is whole."""
    with tmpfs(tmp_path / "disk", "4M") as disk:
        out = disk / "run"
        flags = ["--max_steps", "4", "--checkpoint_every", "1", "--keep_last", "0"]
        result = launch_tiny("train_ddp.py", out, data_cache, *flags, check=False, timeout=120)
        assert_refused(
            result,
            f"the checkpoint of step 2 could not be written to {out / 'checkpoints'} (No space left on device)",
            f"continue from the last complete checkpoint ({out / 'checkpoints' / 'step_1'})",
        )
        assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_1"]
        assert (out / "checkpoints" / "step_1" / "trainer_state.json").is_file()
        assert not (out / ".run.lock").exists()


def test_a_full_disk_during_a_metrics_record_is_one_line_and_leaves_whole_lines(tmp_path):
    from common.metrics import MetricsWriter

    with tmpfs(tmp_path / "disk", "64k") as disk:
        metrics = MetricsWriter(disk, enabled=True)
        metrics.write({"type": "train", "step": 1})
        with open(disk / "filler", "wb", buffering=0) as filler, pytest.raises(OSError):  # the rest of the disk
            while True:
                filler.write(b"x" * 4096)
        with pytest.raises(UsageError, match=f"{disk / 'metrics.jsonl'} could not be written \\(No space left"):
            metrics.write({"type": "train", "step": 2, "pad": "x" * 20000})
        assert (disk / "metrics.jsonl").read_text() == '{"type": "train", "step": 1}\n'


def test_a_read_only_output_dir_is_one_line_before_step_1(tmp_path, data_cache):
    with tmpfs(tmp_path / "ro", "1M", read_only=True) as folder:
        outs = [folder / "run", folder / "run" / "new"]  # a folder there, and one to be made
        common = [*TINY, "--max_steps", "2", "--data_cache_dir", data_cache]
        results = run_refused([("train_ddp.py", [*common, "--output_dir", out]) for out in outs])
        for out, result in zip(outs, results, strict=True):
            assert_refused(result, f"--output_dir {out} cannot be written (Read-only file system)")
            assert "train:" not in result.stderr


# ---------------------------------------------------------------- what would fail after training, tried before step 1
def test_a_checkpoint_that_cannot_be_written_fails_before_step_1(tmp_path, data_cache):
    """A disk too small for one checkpoint: the trial save before step 1 (each rank writes its part, as the run's
    saves do) fails in one line, nothing trained, nothing left (no trial folder, no lock, no run folder). It
    failed at the first checkpoint, after training, before."""
    with tmpfs(tmp_path / "disk", "256k") as disk:
        out = disk / "run"
        flags = ["--max_steps", "4", "--checkpoint_every", "2"]
        result = launch_tiny("train_ddp.py", out, data_cache, *flags, nproc=2, check=False, timeout=120)
        assert_refused(
            result,
            f"a trial checkpoint before step 1 could not be written to {out / '.trial_checkpoint'} "
            "(No space left on device",
            "free space there, or give another --output_dir",
        )
        assert "train:" not in result.stderr
        assert not out.exists(), sorted(out.rglob("*"))


class LockedSchedule:
    """An LR schedule holding something torch.save cannot pickle (a lock): LambdaLR saves its __dict__."""

    def __init__(self):
        import threading

        self.lock = threading.Lock()

    def __call__(self, step: int) -> float:
        return 1.0


def test_a_state_that_cannot_be_saved_fails_before_step_1(tmp_path, state):
    from types import SimpleNamespace

    from common.checkpoint import load_checkpoint, start_point
    from common.output_checks import check_resume_and_output, release_output_dir, trial_checkpoint
    from common.task import Task

    accelerator = SimpleNamespace(
        is_main_process=True, process_index=0, num_processes=1, wait_for_everyone=lambda: None, print=print
    )
    args = argparse.Namespace(
        output_dir=str(tmp_path / "run"), resume_from_checkpoint=None, overwrite_output_dir=False, seed=0,
        max_steps=4, checkpoint_every=2, stop_at_step=None, keep_last=0,
    )  # fmt: skip
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, LockedSchedule())
    try:
        resume_path, facts = start_point(accelerator, args, model, Task(), 8)
        check_resume_and_output(accelerator, args, resume_path, facts)
        load_checkpoint(accelerator, resume_path, model, optimizer, scheduler)
        with pytest.raises(UsageError) as refused:
            trial_checkpoint(accelerator, args, facts, model, optimizer, scheduler)
    finally:
        release_output_dir()
    assert str(refused.value).startswith(
        "a trial checkpoint before step 1 could not be saved (TypeError: cannot pickle '_thread.lock' object)"
    ), refused.value
    assert not (tmp_path / "run").exists(), sorted((tmp_path / "run").rglob("*"))


def test_a_full_disk_during_the_export_is_one_line_and_leaves_no_partial_model(tmp_path, state):
    """The model after training on a disk that cannot hold it: one line (what, the free bytes, the way out), no
    partial folder, and a model/ of an earlier run left whole."""
    from types import SimpleNamespace

    from common.checkpoint import export_model
    from common.task import Task

    accelerator = SimpleNamespace(is_main_process=True, wait_for_everyone=lambda: None)
    with tmpfs(tmp_path / "disk", "64k") as disk:
        (disk / "model").mkdir()
        (disk / "model" / "config.json").write_text("{}")  # an earlier run's model
        with pytest.raises(UsageError) as refused:
            export_model(accelerator, torch.nn.Linear(256, 256), Task(), {}, disk / "model")  # 257 KB of weights
        line, model_dir = str(refused.value), disk / "model"
        assert line.startswith(f"the final model could not be written to {model_dir} (No space left on device; "), line
        assert "free space there, or give another --output_dir" in line and "run again" in line, line
        assert sorted(p.name for p in disk.iterdir()) == ["model"], sorted(disk.rglob("*"))
        assert [p.name for p in (disk / "model").iterdir()] == ["config.json"]


# ---------------------------------------------------------------- data files
BAD_FILES = {  # name -> (the file's bytes, what the line says)
    "empty.jsonl": (b"", "is empty"),
    "blank.txt": (b"\n \n\n", "is empty (only white space)"),
    "binary.txt": (torch.arange(300, dtype=torch.int32).numpy().tobytes() * 20, "is binary, not text (a NUL"),
    "latin1.txt": ("café crème\n".encode("latin-1") * 200, "is not UTF-8 text (byte 3 cannot be decoded)"),
    "broken.jsonl": (b'{"text": "a"}\n{"text": "b\n', "cannot be read as JSON (ArrowInvalid: JSON parse error"),
    "numbers.jsonl": (b"".join(b'{"text": %d}\n' % i for i in range(300)), "its column 'text' holds int64 values"),
    "lists.jsonl": (b'{"text": ["a", "b"]}\n' * 300, "its column 'text' holds lists, not text"),
    "broken.csv": (b"text\n" + b"some text\n" * 10 + b"a,b,c\n", "cannot be read as CSV (ParserError"),
}


@pytest.fixture(scope="module")
def state():
    from accelerate import PartialState

    return PartialState(cpu=True)


def load(tmp_path, state, *flags):
    from common.data import load_data

    parser = argparse.ArgumentParser()
    add_data_args(parser)
    return load_data(parser.parse_args(["--data_cache_dir", str(tmp_path / "cache"), *flags]), state, 32)


@pytest.mark.parametrize("name", list(BAD_FILES))
def test_a_bad_train_file_is_one_line_naming_it(name, tmp_path, state):
    content, what = BAD_FILES[name]
    (tmp_path / name).write_bytes(content)
    with pytest.raises(UsageError) as refused:
        load(tmp_path, state, "--train_file", str(tmp_path / name))
    assert str(refused.value).startswith(f"--train_file {tmp_path / name}"), refused.value
    assert what in str(refused.value)


def test_a_bad_validation_file_is_named_not_the_train_file(tmp_path, state):
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": t} for t in DOCUMENTS])
    validation = tmp_path / "validation.jsonl"
    validation.write_bytes(BAD_FILES["broken.jsonl"][0])
    with pytest.raises(UsageError, match=f"^--validation_file {validation} cannot be read as JSON"):
        load(tmp_path, state, "--train_file", str(train), "--validation_file", str(validation))
    write_jsonl(validation, [{"text": 5}, {"text": 6}])
    with pytest.raises(UsageError, match=f"^--validation_file {validation}: its column 'text' holds int64"):
        load(tmp_path, state, "--train_file", str(train), "--validation_file", str(validation))


# ---------------------------------------------------------------- slurm/local_nodes.py
@pytest.mark.parametrize(
    "args, line",
    [
        (["--nodes", "0", "scripts/train_ddp.py"], "--nodes 0 --nproc_per_node 1: each must be at least 1"),
        (["scripts/no_such_script.py", "--max_steps", "2"], "scripts/no_such_script.py: no such training script"),
        ([], "the training script is missing"),
    ],
)
def test_local_nodes_refuses_a_bad_command_in_one_line(args, line):
    result = run_cmd([sys.executable, str(REPO / "slurm" / "local_nodes.py"), *args], timeout=60)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: local_nodes.py: {line}"), lines[0]
