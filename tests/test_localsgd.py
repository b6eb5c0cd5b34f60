"""train_localsgd.py and merge_checkpoints.py: real 2-process CPU launches."""

import json
import sys

import pytest
from safetensors.torch import load_file

from conftest import (
    SCRIPTS,
    TINY,
    accelerate_launch_cmd,
    assert_same_losses,
    free_port,
    launch,
    launch_tiny,
    read_metrics,
    run_cmd,
    train_losses,
)

# one xdist worker runs these tests: its module fixture launches the run that most of its tests check
pytestmark = pytest.mark.xdist_group("localsgd")

SGD = ["--optimizer", "sgd", "--learning_rate", "0.1", "--max_grad_norm", "0"]
MERGE = [sys.executable, str(SCRIPTS / "merge_checkpoints.py")]


@pytest.fixture(scope="module")
def k4_run(tmp_path_factory, data_cache):
    """AdamW, fusion every 4 steps, 10 steps: fusions at 4, 8 and the end; rank models saved."""
    out = tmp_path_factory.mktemp("localsgd") / "k4"
    flags = ["--max_steps", "10", "--sync_every", "4", "--batch_size", "8", "--save_rank_models"]
    launch_tiny("train_localsgd.py", out, data_cache, *flags, nproc=2)
    return out


def test_sync_every_step_with_sgd_equals_ddp(tmp_path, data_cache):
    """K = 1 with plain SGD is DDP, on `addition`, whose samples hold 2 to 5 targets: each rank's
    loss must be divided by the global batch's target count, not its own (an own count drifts
    by 1e-4 within 10 steps)."""
    common = [*TINY, *SGD, "--max_steps", "10", "--data_cache_dir", data_cache]
    launch("train_ddp.py", [*common, "--batch_size", "8", "--output_dir", str(tmp_path / "ddp")], nproc=1)
    launch(
        "train_localsgd.py",
        [*common, "--batch_size", "4", "--sync_every", "1", "--output_dir", str(tmp_path / "local")],
        nproc=2,
    )
    assert_same_losses(train_losses(tmp_path / "ddp"), train_losses(tmp_path / "local"), list(range(1, 11)), tol=2e-6)


def test_replicas_are_identical_right_after_each_fusion_only(k4_run):
    train = {r["step"]: r for r in read_metrics(k4_run) if r["type"] == "train"}
    assert [s for s, r in train.items() if r["fused"]] == [4, 8]
    for step, record in train.items():
        if record["fused"]:
            assert record["param_spread"] == 0.0, f"step {step}: replicas differ right after a fusion"
        else:
            assert record["param_spread"] > 0.0, f"step {step}: replicas identical between fusions"
    final = [r for r in read_metrics(k4_run) if r.get("fused_model")]
    assert len(final) == 1 and final[0]["param_spread"] == 0.0


def test_communication_is_k_times_less_than_ddp(k4_run):
    summary = read_metrics(k4_run)[-1]
    assert summary["fusions"] == 3 and summary["param_allreduce_calls"] == 3 * 37  # 37 parameter tensors in tiny
    assert summary["allreduce_mib_per_step_per_rank"] == pytest.approx(
        summary["ddp_allreduce_mib_per_step_per_rank"] * 3 / 10, rel=1e-3
    )


def test_saved_model_is_the_fused_one_and_equals_the_merged_rank_models(k4_run, tmp_path):
    """The rank models are saved right before the final fusion: averaging them must give model/."""
    merged = tmp_path / "merged"
    ranks = [str(k4_run / "rank_models" / f"rank_{r}") for r in (0, 1)]
    result = run_cmd([*MERGE, *ranks, "--out", str(merged)])
    assert result.returncode == 0, result.stderr[-2000:]
    fused, averaged = (
        load_file(str(k4_run / "model" / "model.safetensors")),
        load_file(str(merged / "model.safetensors")),
    )
    rank0 = load_file(str(k4_run / "rank_models" / "rank_0" / "model.safetensors"))
    assert fused.keys() == averaged.keys()
    assert all((fused[k] == averaged[k]).all() for k in fused)
    assert any((fused[k] != rank0[k]).any() for k in fused), "the rank models should differ from the fused one"
    out = tmp_path / "eval.json"
    launch("evaluate.py", ["--model_dir", str(k4_run / "model"), "--output_file", str(out)], nproc=1)
    final = [r for r in read_metrics(k4_run) if r.get("fused_model")][0]
    assert json.loads(out.read_text())["eval_loss"] == pytest.approx(final["eval_loss"], abs=1e-6)


def test_merging_a_model_with_itself_returns_it(k4_run, tmp_path):
    model = k4_run / "model"
    result = run_cmd([*MERGE, str(model), str(model), "--weights", "3", "1", "--out", str(tmp_path / "same")])
    assert result.returncode == 0, result.stderr[-2000:]
    a, b = load_file(str(model / "model.safetensors")), load_file(str(tmp_path / "same" / "model.safetensors"))
    assert all((a[k] == b[k]).all() for k in a)
    assert json.loads((tmp_path / "same" / "config.json").read_text()) == json.loads(
        (model / "config.json").read_text()
    )


def test_resume_is_exact(tmp_path, data_cache):
    """Replicas and their Adam states differ between fusions: every rank saves and restores its own."""
    args = [
        *TINY,
        "--max_steps",
        "10",
        "--sync_every",
        "3",
        "--batch_size",
        "8",
        "--data_cache_dir",
        data_cache,
        "--checkpoint_every",
        "5",
    ]
    launch("train_localsgd.py", [*args, "--output_dir", str(tmp_path / "straight")], nproc=2)
    launch("train_localsgd.py", [*args, "--output_dir", str(tmp_path / "resumed"), "--stop_at_step", "5"], nproc=2)
    launch(
        "train_localsgd.py",
        [*args, "--output_dir", str(tmp_path / "resumed"), "--resume_from_checkpoint", "latest"],
        nproc=2,
    )
    straight, resumed = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    assert_same_losses(
        train_losses(tmp_path / "straight"), train_losses(tmp_path / "resumed"), list(range(6, 11)), tol=1e-6
    )
    spread = lambda records: {r["step"]: r["param_spread"] for r in records if r["type"] == "train"}  # noqa: E731
    assert spread(straight)[7] == pytest.approx(spread(resumed)[7], rel=1e-6) and spread(straight)[7] > 0


def assert_one_error(result, needle):
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode != 0 and len(errors) == 1 and needle in errors[0], result.stderr[-2000:]


def test_merge_of_missing_rank_models_names_save_rank_models(tmp_path):
    """rank_models/rank_N exist only if train_localsgd.py ran with --save_rank_models: say so."""
    ranks = [tmp_path / "run" / "rank_models" / f"rank_{r}" for r in (0, 1)]
    result = run_cmd([*MERGE, *map(str, ranks), "--out", str(tmp_path / "fused")], timeout=120)
    assert_one_error(result, "no model.safetensors")
    assert (
        "train_localsgd.py writes OUTPUT_DIR/rank_models/rank_N only when run with --save_rank_models" in result.stderr
    )
    assert not (tmp_path / "fused").exists()


def test_bad_input(k4_run, tmp_path, data_cache):
    result = launch("train_localsgd.py", [*TINY, "--sync_every", "0", "--output_dir", str(tmp_path / "a")], check=False)
    assert_one_error(result, "--sync_every must be at least 1")
    assert not (tmp_path / "a").exists()

    cmd = accelerate_launch_cmd(
        ["--use_fsdp", "--num_processes", "2", "--num_machines", "1", "--main_process_port", str(free_port())],
        "train_localsgd.py",
        [*TINY, "--data_cache_dir", data_cache, "--output_dir", str(tmp_path / "b")],
    )
    assert_one_error(run_cmd(cmd), "cannot run under FSDP")

    other = tmp_path / "other"
    launch(
        "train_ddp.py",
        [*TINY, "--n_layer", "3", "--max_steps", "1", "--data_cache_dir", data_cache, "--output_dir", str(other)],
    )
    assert_one_error(
        run_cmd([*MERGE, str(k4_run / "model"), str(other / "model"), "--out", str(tmp_path / "m")]),
        "only models of one config",
    )
    assert_one_error(
        run_cmd([*MERGE, str(k4_run / "model"), str(tmp_path / "nowhere"), "--out", str(tmp_path / "m")]),
        "no model.safetensors",
    )
    assert not (tmp_path / "m").exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    assert_one_error(run_cmd([*MERGE, str(k4_run / "model"), "--out", str(existing)]), "already exists")
    assert (existing / "keep.txt").read_text() == "mine"
