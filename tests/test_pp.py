"""train_pp.py: pure pipeline parallelism (torch.distributed.pipelining), every schedule, against the
single-process run of the same 4-layer model; what it refuses (dp x pp is train_hybrid.py's)."""

import pytest

from conftest import TINY, assert_layout, assert_matches_reference, launch_tiny, resume_and_evaluate, summary

# one xdist worker runs these tests: its parity runs are also the straight runs of its resume tests (shared_run)
pytestmark = pytest.mark.xdist_group("pp")

FLAGS = ["--n_layer", "4", "--max_steps", "20", "--batch_size", "16"]  # one evaluation, at the end
STEPS = list(range(1, 21))


def split_points(pp: int, schedule: str) -> list[str]:
    """An uneven split for one case (the first stage 1 layer, the second 3); the others split evenly."""
    return ["--split_points", "1"] if (pp, schedule) == (2, "gpipe") else []


SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"]


def parity_run(pp: int, schedule: str) -> tuple:
    extra = ["--stages_per_rank", "1"] if pp == 4 else []
    return ("train_pp.py", pp, *FLAGS, "--schedule", schedule, *extra, *split_points(pp, schedule))


# the eight runs: the four schedules on 2 processes in one launch, on 4 in another (shared_run.in_turn)
PARITY_RUNS = [parity_run(pp, schedule) for pp in (2, 4) for schedule in SCHEDULES]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("pp", [2, 4])
def test_matches_single_process(pp, schedule, reference, shared_run):
    """2 stages: interleaved and zero-bubble hold 2 stages per rank (4 stages of 1 layer), GPipe
    splits unevenly (1 layer, then 3); 4 stages: one layer per rank. 4 micro-batches of 4."""
    shared_run.in_turn(PARITY_RUNS)
    out = shared_run(*parity_run(pp, schedule))
    assert_layout(out, pp=pp, dp_shard=1, tp=1)
    ref = reference(*FLAGS, "--eval_batch_size", "64")
    # the mean over the global batch, written by rank 0
    assert_matches_reference(ref, out, STEPS)  # evaluation: forward-only through the pipeline
    s = summary(out)
    assert s["bubble_theory"] == pytest.approx(
        (pp - 1) / ((2 if pp == 2 and schedule in ("interleaved_1f1b", "zero_bubble") else 1) * 4 + pp - 1), abs=1e-4
    )
    assert len(s["bubble_measured_per_rank"]) == pp and all(0 <= b < 1 for b in s["bubble_measured_per_rank"])
    if schedule == "gpipe":  # every stage holds all micro-batches' activations before the first backward
        assert s["max_microbatches_in_flight_per_rank"] == [4] * pp
    if schedule == "1f1b":  # stage i holds at most pp - i
        assert s["max_microbatches_in_flight_per_rank"] == [pp - i for i in range(pp)]
    assert s["state_bytes_per_rank_max"]["param_bytes"] < s["unsharded_param_bytes"]


def test_resume_under_pp_is_exact_and_final_model_evaluates(tmp_path, data_cache, shared_run):
    """10 + resume 10 == 20 straight, both under PP, within 1e-6; then evaluate.py on one
    process reproduces the run's last evaluation from the consolidated model/."""
    schedule = ["--schedule", "gpipe", *split_points(2, "gpipe")]
    flags = [*TINY, *FLAGS, *schedule, "--data_cache_dir", data_cache]
    shared_run.in_turn(PARITY_RUNS)
    straight = shared_run("train_pp.py", 2, *FLAGS, *schedule)  # also a case of the test above
    resume_and_evaluate("train_pp.py", flags, tmp_path, straight)


def assert_refused(result, *needles: str) -> None:
    """Refused with one `error:` line holding every needle."""
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr[-3000:]
    for needle in needles:
        assert needle in errors[0], errors[0]


@pytest.mark.parametrize(
    "nproc, flags, needles",
    [
        # one strategy per file: pipelines trained data parallel are train_hybrid.py's
        (2, ["--pp_size", "1"], ["--pp_size 1 on 2 processes", "train_hybrid.py", "--pp_size N --dp_shard M"]),
        # the stage count comes from the model's units (Task.units), not from a GPT config
        (2, ["--n_layer", "1"], ["--pp_size 2 x --stages_per_rank 1 = 2 stages, but the model has 1 units (Block)"]),
        (1, ["--n_layer", "1", "--schedule", "interleaved_1f1b"], ["= 2 stages, but the model has 1 units"]),
    ],
)
def test_refused_before_any_work(nproc, flags, needles, tmp_path, data_cache):
    out = tmp_path / "run"
    result = launch_tiny("train_pp.py", out, data_cache, "--max_steps", "2", *flags, nproc=nproc, check=False)
    assert_refused(result, *needles)
    assert not out.exists() or not any(out.iterdir()), "a refused run wrote output"
