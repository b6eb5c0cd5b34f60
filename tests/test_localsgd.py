"""train_localsgd.py (Local SGD, DiLoCo, Streaming DiLoCo) and merge_checkpoints.py: real 2-process CPU launches."""

import json
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import (
    SCRIPTS,
    TINY,
    accelerate_launch_cmd,
    assert_same_losses,
    free_port,
    launch,
    launch_tiny,
    local_sgd_reference,
    read_metrics,
    run_cmd,
    run_in_turn,
    run_refused,
    train_losses,
)

# the tests of the shared runs stay on one xdist worker (one launch runs them all); the others spread over both
K4_GROUP = STREAMING_GROUP = pytest.mark.xdist_group("localsgd")  # the module's 2-process runs share one launch

SGD = ["--optimizer", "sgd", "--learning_rate", "0.1", "--max_grad_norm", "0"]
MERGE = [sys.executable, str(SCRIPTS / "merge_checkpoints.py")]
K4 = ["--max_steps", "10", "--sync_every", "4", "--batch_size", "8"]
# Streaming DiLoCo: tiny's 2 blocks in 2 fragments, fragment 0 fused at steps 4, 8, fragment 1 at 2, 6, 10
STREAMING = [
    *K4,
    "--outer_optimizer",
    "nesterov",
    "--fragments",
    "2",
    "--outer_dtype",
    "bf16",
    "--checkpoint_every",
    "5",
]


OUTER_AVERAGING = [*K4, "--outer_optimizer", "nesterov", "--outer_lr", "1", "--outer_momentum", "0"]
DILOCO_7 = ["--max_steps", "7", "--sync_every", "3", "--batch_size", "8", "--outer_optimizer", "nesterov"]
DILOCO_7 += ["--checkpoint_every", "6", "--save_rank_models"]
SYNC_EVERY_STEP = ["--max_steps", "10", *SGD, "--batch_size", "4", "--sync_every", "1"]
# overlapped DiLoCo: the fusions started at 4 and 8 land at 6 and 10; the step-5 checkpoint holds one in flight
OVERLAP = [*K4, "--outer_optimizer", "nesterov", "--overlap_steps", "2", "--checkpoint_every", "5"]
NO_MOMENTUM = ["--sync_every", "4", "--batch_size", "8", "--outer_optimizer", "nesterov", "--outer_momentum", "0"]
# the module's 2-process runs, in one launch, in turn (run_in_turn); a name twice: the same output, a resume
RUNS = [
    ("k4", [*K4, "--save_rank_models"]),  # AdamW, fusion every 4 steps, 10 steps: fusions at 4, 8 and the end
    ("streaming", STREAMING),  # Streaming DiLoCo (Nesterov outer SGD, 2 fragments, bf16 all-reduce), a checkpoint at 5
    ("outer_averaging", OUTER_AVERAGING),
    ("diloco_7", DILOCO_7),
    ("sync_every_step", SYNC_EVERY_STEP),
    ("overlap", OVERLAP),
    ("overlap_resumed", [*OVERLAP, "--stop_at_step", "5"]),
    ("overlap_resumed", [*OVERLAP, "--resume_from_checkpoint", "latest"]),
    ("no_momentum_4", [*NO_MOMENTUM, "--max_steps", "4"]),  # one fusion, at the last step
    ("overlap_unmixed_6", [*NO_MOMENTUM, "--max_steps", "6", "--overlap_steps", "2", "--overlap_mix", "0"]),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache) -> dict:
    folder = tmp_path_factory.mktemp("localsgd")
    outs = {name: folder / name for name, _ in RUNS}
    cases = [
        [str(SCRIPTS / "train_localsgd.py"), [*TINY, *flags, "--data_cache_dir", data_cache, "--output_dir", str(out)]]
        for name, flags in RUNS
        for out in [outs[name]]
    ]
    for (name, _), result in zip(RUNS, run_in_turn(cases, 2, folder), strict=True):
        assert result["returncode"] == 0, f"{name}: exit {result['returncode']}\n{result['stderr']}"
    return outs


@pytest.fixture(scope="module")
def k4_run(runs):
    return runs["k4"]


@pytest.fixture(scope="module")
def streaming_run(runs):
    return runs["streaming"]


@K4_GROUP
def test_sync_every_step_with_sgd_equals_ddp(runs, tmp_path, data_cache):
    """K = 1 with plain SGD is DDP, on `addition`, whose samples hold 2 to 5 targets: each rank's
    loss must be divided by the global batch's target count, not its own (an own count drifts
    by 1e-4 within 10 steps)."""
    common = [*TINY, *SGD, "--max_steps", "10", "--data_cache_dir", data_cache]
    launch("train_ddp.py", [*common, "--batch_size", "8", "--output_dir", str(tmp_path / "ddp")], nproc=1)
    local = runs["sync_every_step"]
    assert_same_losses(train_losses(tmp_path / "ddp"), train_losses(local), list(range(1, 11)), tol=2e-6)


@K4_GROUP
@pytest.mark.parametrize("name", ["k4", "diloco_7"])
def test_run_matches_its_replicas_side_by_side(name, runs, tmp_path, data_cache):
    """AdamW inside, averaged every 4 steps (k4) or DiLoCo's Nesterov every 3 (diloco_7): 2 processes = the two
    replicas trained in one process on the micro-batches each rank takes, fused the same way
    (tests/localsgd_reference.py), within 1e-5 at every step and in the fused model's evaluation."""
    flags = dict(RUNS)[name]
    ref_losses, ref_eval = local_sgd_reference(flags, 2, tmp_path, data_cache)
    steps = sorted(ref_losses)
    assert_same_losses(ref_losses, train_losses(runs[name]), steps, tol=1e-5)
    final = [r for r in read_metrics(runs[name]) if r.get("fused_model")]
    assert len(final) == 1 and abs(final[0]["eval_loss"] - ref_eval) < 1e-5


@K4_GROUP
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


@K4_GROUP
def test_communication_is_k_times_less_than_ddp_in_one_all_reduce_per_fusion(k4_run):
    """Counted by a dispatch mode around each fusion: ONE all-reduce of the flat model (Accelerate's LocalSGD
    makes one per tensor: 37 in tiny)."""
    summary = read_metrics(k4_run)[-1]
    assert summary["fusions"] == 3 and summary["fusion_allreduce_calls"] == 3
    ddp = summary["ddp_allreduce_mib_per_step_per_rank"]
    assert summary["fusion_allreduce_buffer_mib"] == pytest.approx(3 * ddp, rel=1e-3)  # fp32 model, 2 ranks
    assert summary["allreduce_mib_per_step_per_rank"] == pytest.approx(ddp * 3 / 10, rel=1e-3)


@K4_GROUP
def test_nesterov_with_lr_1_and_no_momentum_is_averaging(k4_run, runs):
    """θ_last − mean(θ_last − θ_r) = mean(θ_r): DiLoCo's outer step at lr 1, momentum 0 is Local SGD."""
    out = runs["outer_averaging"]
    assert_same_losses(train_losses(k4_run), train_losses(out), list(range(1, 11)), tol=1e-6)
    a, b = load_file(str(k4_run / "model" / "model.safetensors")), load_file(str(out / "model" / "model.safetensors"))
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6


@K4_GROUP
def test_outer_step_is_torch_sgd_with_nesterov(runs):
    """The final fusion recomputed in the test: θ_last and the outer momentum from the step-6 checkpoint (after
    the fusions at 3 and 6), the two ranks' models saved at step 7 before the final fusion, and
    torch.optim.SGD(nesterov=True)."""
    out = runs["diloco_7"]
    outer = torch.load(out / "checkpoints" / "step_6" / "extra_state.pt", weights_only=True)
    names, last = outer["names"][0], [t.clone() for t in outer["last"][0]]
    assert outer["outer"][0]["state"], "the first fusion left no momentum"
    ranks = [load_file(str(out / "rank_models" / f"rank_{r}" / "model.safetensors")) for r in (0, 1)]
    reference = torch.optim.SGD(last, lr=0.7, momentum=0.9, nesterov=True)
    reference.load_state_dict(outer["outer"][0])
    for name, t in zip(names, last):
        t.grad = t - (ranks[0][name] + ranks[1][name]) / 2  # the averaged pseudo-gradient
    reference.step()
    fused = load_file(str(out / "model" / "model.safetensors"))
    assert sorted(names) == sorted(fused)
    assert max((fused[name] - t).abs().max().item() for name, t in zip(names, last)) < 1e-6
    assert max((fused[n] - ranks[0][n]).abs().max().item() for n in names) > 1e-3  # the step moved the model


@STREAMING_GROUP
def test_streaming_fuses_each_fragment_exactly_at_its_steps(streaming_run):
    """Fragment f at the steps = f*K/F (mod K): its replicas agree right after, and only then; the other
    fragment is left as it is (its replicas still differ)."""
    records = read_metrics(streaming_run)
    train = {r["step"]: r for r in records if r["type"] == "train"}
    assert {s: r["fused_fragments"] for s, r in train.items() if r["fused_fragments"]} == {
        2: [1],
        4: [0],
        6: [1],
        8: [0],
        10: [1],
    }
    for step, record in train.items():
        for fragment, spread in enumerate(record["fragment_spread"]):
            if fragment in record["fused_fragments"]:
                assert spread == 0.0, f"step {step}: fragment {fragment} differs right after its fusion"
            else:
                assert spread > 0.0, f"step {step}: fragment {fragment} agrees although it was not fused"
    summary = records[-1]
    assert summary["fusions_per_fragment"] == [3, 3]  # fragment 0 once more in the final fusion
    assert summary["fusion_allreduce_calls"] == summary["fusions"] == 6
    # bf16 halves the bytes of the whole model's fusion (DDP's bytes per step); fragments split them further
    ddp = summary["ddp_allreduce_mib_per_step_per_rank"]
    assert summary["fusion_mib_per_rank"] == pytest.approx(3 * ddp / 2, rel=1e-3)  # each fragment 3 times, in bf16
    assert summary["peak_fusion_mib_per_rank"] < 0.6 * ddp / 2


@K4_GROUP
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


@K4_GROUP
def test_merging_a_model_with_itself_returns_it(k4_run, tmp_path):
    model = k4_run / "model"
    result = run_cmd([*MERGE, str(model), str(model), "--weights", "3", "1", "--out", str(tmp_path / "same")])
    assert result.returncode == 0, result.stderr[-2000:]
    a, b = load_file(str(model / "model.safetensors")), load_file(str(tmp_path / "same" / "model.safetensors"))
    assert all((a[k] == b[k]).all() for k in a)
    assert json.loads((tmp_path / "same" / "config.json").read_text()) == json.loads(
        (model / "config.json").read_text()
    )


@STREAMING_GROUP
def test_resume_between_fusions_is_exact_with_the_outer_momentum(streaming_run, tmp_path, data_cache):
    """Replicas and their Adam states differ between fusions (every rank saves its own); θ_last and the
    outer momentum are restored from the checkpoint, so the fusions at 6, 8 and 10 match the straight run."""
    resumed = tmp_path / "resumed"
    launch_tiny("train_localsgd.py", resumed, data_cache, *STREAMING, "--stop_at_step", "5", nproc=2)
    launch_tiny("train_localsgd.py", resumed, data_cache, *STREAMING, "--resume_from_checkpoint", "latest", nproc=2)
    assert_same_losses(train_losses(streaming_run), train_losses(resumed), list(range(6, 11)), tol=1e-6)
    a, b = (
        load_file(str(streaming_run / "model" / "model.safetensors")),
        load_file(str(resumed / "model" / "model.safetensors")),
    )
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6
    other = tmp_path / "other"
    launch_tiny("train_localsgd.py", other, data_cache, *K4, "--checkpoint_every", "5", "--stop_at_step", "5", nproc=2)
    result = launch_tiny(
        "train_localsgd.py", other, data_cache, *STREAMING, "--resume_from_checkpoint", "latest", nproc=2, check=False
    )
    assert_one_error(result, "saved with --outer_optimizer average, --fragments 1; resume with the same flags")
    # the same averaging checkpoint on 1 process (an elastic restart that lost a node): step 5 is 1 local step past
    # the fusion of step 4, and averaging keeps no copy of the fused model: refused, the checkpoint untouched
    result = launch_tiny(
        "train_localsgd.py", other, data_cache, *K4, "--resume_from_checkpoint", "latest", "--global_batch_size", "16",
        check=False,
    )  # fmt: skip
    assert_one_error(result, "saved by 2 replicas at step 5, 1 local step after a fusion, and --outer_optimizer")
    assert (other / "checkpoints" / "step_5").is_dir()


@K4_GROUP
def test_overlapped_fusion_without_mix_lands_the_synchronous_fusion_tau_steps_later(runs):
    """--overlap_steps 2 --overlap_mix 0: the fusion started at step 4 lands at 6 as exactly the model the synchronous
    fusion gives at 4 (the 2 inner steps meanwhile are dropped); at 6 it is also the final model (the final fusion's
    pseudo-gradient is 0, and without momentum the outer step stays)."""
    synchronous, overlapped = runs["no_momentum_4"], runs["overlap_unmixed_6"]
    a = load_file(str(synchronous / "model" / "model.safetensors"))
    b = load_file(str(overlapped / "model" / "model.safetensors"))
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0.0
    train = {r["step"]: r for r in read_metrics(overlapped) if r["type"] == "train"}
    assert [s for s, r in train.items() if r["fused"]] == [4] and train[6]["param_spread"] == 0.0
    assert train[5]["param_spread"] > 0.0  # the all-reduce is in flight: the replicas go on alone


@K4_GROUP
def test_overlapped_fusion_mixes_and_resumes_exactly_from_a_fusion_in_flight(runs, tmp_path, data_cache):
    """α = 0.5: after landing the replicas still differ (each keeps half of its own); the final model is one. The
    step-5 checkpoint holds the fusion started at 4, arrived: the resumed run lands it at 6 as the straight run does.
    On one process (a node lost) it lands at once, and the replica continues from the fusion of step 4."""
    straight, resumed = runs["overlap"], runs["overlap_resumed"]
    train = {r["step"]: r for r in read_metrics(straight) if r["type"] == "train"}
    assert [s for s, r in train.items() if r["fused"]] == [4, 8]
    assert all(r["param_spread"] > 0.0 for r in train.values())
    assert [r for r in read_metrics(straight) if r.get("fused_model")][0]["param_spread"] == 0.0
    summary = read_metrics(straight)[-1]
    assert summary["fusions"] == 3 and summary["overlap_steps"] == 2 and summary["fusion_wait_s"] >= 0.0
    assert_same_losses(train_losses(straight), train_losses(resumed), list(range(6, 11)), tol=1e-6)
    a = load_file(str(straight / "model" / "model.safetensors"))
    b = load_file(str(resumed / "model" / "model.safetensors"))
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6
    in_flight = torch.load(resumed / "checkpoints" / "step_5" / "extra_state.pt", weights_only=True)["in_flight"]
    assert in_flight["fragment"] == 0 and in_flight["step"] == 4 and in_flight["mean"].abs().max() > 0
    alone = tmp_path / "alone"
    shutil.copytree(resumed / "checkpoints" / "step_5", alone / "checkpoints" / "step_5")
    result = launch_tiny(
        "train_localsgd.py", alone, data_cache, *OVERLAP, "--resume_from_checkpoint", "latest",
        "--global_batch_size", "16", nproc=1,
    )  # fmt: skip
    assert "continues from the model of the last fusion (step 4), dropping the 1 local step" in result.stdout


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


@K4_GROUP
def test_bad_input(k4_run, tmp_path, data_cache):
    refused = [  # one-process runs refused at start: in one interpreter, one after the other
        (["--sync_every", "0"], "--sync_every must be at least 1"),
        (["--sync_every", "4", "--fragments", "3"], "--fragments 3 must divide --sync_every 4"),
        (["--outer_optimizer", "nesterov", "--outer_lr", "0"], "the outer learning rate must be above 0"),
        (["--outer_dtype", "bf16"], "--outer_dtype bf16 needs --outer_optimizer nesterov"),
        (["--sync_every", "3", "--fragments", "3"], "the model has 2 blocks"),
        (
            ["--outer_optimizer", "nesterov", "--sync_every", "4", "--overlap_steps", "5"],
            "--overlap_steps 5 must be between 1 and",
        ),
        (["--overlap_steps", "2"], "with --outer_optimizer nesterov"),
        (["--outer_optimizer", "nesterov", "--overlap_steps", "2", "--overlap_mix", "1"], "--overlap_mix 1.0 must be"),
    ]
    common = [*TINY, "--data_cache_dir", data_cache]
    cases = [
        ("train_localsgd.py", [*common, *flags, "--output_dir", tmp_path / f"f{i}"])
        for i, (flags, _) in enumerate(refused)
    ]
    for i, ((_, needle), result) in enumerate(zip(refused, run_refused(cases), strict=True)):
        assert_one_error(result, needle)
        assert not (tmp_path / f"f{i}").exists()

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
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    other_config, nowhere, already = run_refused(
        [
            ("merge_checkpoints.py", [k4_run / "model", other / "model", "--out", tmp_path / "m"]),
            ("merge_checkpoints.py", [k4_run / "model", tmp_path / "nowhere", "--out", tmp_path / "m"]),
            ("merge_checkpoints.py", [k4_run / "model", "--out", existing]),
        ]
    )
    assert_one_error(other_config, "only models of one config")
    assert_one_error(nowhere, "no model.safetensors")
    assert not (tmp_path / "m").exists()
    assert_one_error(already, "already exists")
    assert (existing / "keep.txt").read_text() == "mine"


def test_replicas_between_fusions_resumed_by_ddp_start_from_one_model(tmp_path, data_cache):
    """A Local SGD checkpoint saved between fusions holds one replica per rank. Resumed by train_ddp.py,
    every rank starts from replica 0's (and says so): 1 and 2 processes then give the same run. Before,
    each of 2 DDP ranks loaded its own replica and DDP kept them apart (8.5e-4 off at the next step)."""
    saved = tmp_path / "localsgd"
    common = [*TINY, "--batch_size", "8", "--data_cache_dir", data_cache]
    launch(
        "train_localsgd.py",
        [
            *common,
            "--max_steps",
            "6",
            "--sync_every",
            "4",
            "--stop_at_step",
            "2",
            "--checkpoint_every",
            "2",
            "--output_dir",
            str(saved),
        ],
        nproc=2,
    )
    checkpoint = saved / "checkpoints" / "step_2"
    runs = {}
    for nproc, batch in ((1, "16"), (2, "8")):
        runs[nproc] = tmp_path / f"ddp{nproc}"
        flags = [*TINY, "--batch_size", batch, "--data_cache_dir", data_cache, "--max_steps", "6"]
        result = launch(
            "train_ddp.py",
            [*flags, "--resume_from_checkpoint", str(checkpoint), "--output_dir", str(runs[nproc])],
            nproc=nproc,
        )
        assert "every rank starts from replica 0's model" in result.stdout, result.stdout[-2000:]
    assert_same_losses(train_losses(runs[1]), train_losses(runs[2]), range(3, 7), 1e-5)
