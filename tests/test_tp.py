"""train_tp.py: Megatron-style tensor parallelism (DTensor), against the single-process run."""

import pytest

from conftest import TINY, assert_layout, assert_matches_reference, launch_tiny, resume_and_evaluate, summary

# one xdist worker runs these tests: its parity runs are also the straight runs of its resume tests (shared_run)
pytestmark = pytest.mark.xdist_group("tp")

# 4-digit addition: 16-token rows, which 2 and 4 ranks can split for sequence parallel;
# answers have 2 to 6 target tokens, so micro-batches hold unequal target counts.
FLAGS = [
    "--max_steps",
    "20",
    "--batch_size",
    "16",
    "--addition_digits",
    "4",
    "--eval_every",
    "10",
    "--eval_batch_size",
    "64",
]
STEPS = list(range(1, 21))


@pytest.mark.parametrize(
    "nproc, extra",
    [
        (2, []),
        (2, ["--sequence_parallel"]),
        (2, ["--loss_parallel"]),
        (4, []),
        (4, ["--sequence_parallel", "--loss_parallel"]),
    ],
)
def test_matches_single_process(nproc, extra, reference, shared_run):
    out = shared_run("train_tp.py", nproc, *FLAGS, *extra)
    assert_layout(out, tp=nproc, dp_shard=1, pp=1)
    ref = reference(*FLAGS)
    assert_matches_reference(ref, out, STEPS)  # evals: reduced over the data-parallel group only, each sample once
    s = summary(out)
    assert s["state_bytes_per_rank_max"]["param_bytes"] < 0.6 * s["unsharded_param_bytes"]  # the big matrices are split
    if extra == ["--loss_parallel"]:
        assert_communication_matches_megatron(s)


def test_tp_size_1_trains_fsdp_over_all_ranks(reference, tmp_path, data_cache):
    """--tp_size 1 on 2 processes: a TP group of one rank has nothing to split, so the plan is not
    applied and the two ranks train FSDP; the run says so and still matches."""
    out = tmp_path / "tp1"
    result = launch_tiny("train_tp.py", out, data_cache, *FLAGS, "--tp_size", "1", "--batch_size", "8", nproc=2)
    assert "tensor parallel: 1 rank per group (FSDP over the 2 ranks): nothing to split" in result.stdout
    assert_layout(out, tp=1, dp_shard=2, pp=1)
    assert_matches_reference(reference(*FLAGS), out, STEPS)
    assert summary(out)["collectives_first_step_rank0"]["all_gather"]["calls"] == 5  # FSDP's, and no TP all-reduce
    assert "all_reduce" not in summary(out)["collectives_first_step_rank0"]


def assert_communication_matches_megatron(s: dict) -> None:
    """Measured collectives of one step vs Megatron's count: per layer 2 all-reduces forward and 2
    backward of b*s*d, plus the vocab-parallel embedding's (forward) and the head input's (backward)."""
    comm, n_layer, activation_mib = s["collectives_first_step_rank0"], 2, 16 * 16 * 64 * 4 / 2**20
    assert s["megatron_allreduces_per_step"] == 4 * n_layer
    assert set(comm) == {"all_reduce"}, comm  # loss parallel: the logits are never gathered
    assert comm["all_reduce"]["calls"] == 4 * n_layer + 2
    assert abs(comm["all_reduce"]["mib"] - (4 * n_layer + 2) * activation_mib) < 1e-3


def test_resume_is_exact_and_final_model_evaluates(tmp_path, data_cache, shared_run):
    flags = [*TINY, *FLAGS, "--data_cache_dir", data_cache, "--sequence_parallel"]
    straight = shared_run("train_tp.py", 2, *FLAGS, "--sequence_parallel")  # also a case of the test above
    resume_and_evaluate("train_tp.py", flags, tmp_path, straight)
