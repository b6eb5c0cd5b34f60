"""train_fsdp.py: FSDP2 (fully_shard) against the single-process run; exact memory accounting."""

import pytest

from conftest import TINY, assert_layout, assert_matches_reference, resume_and_evaluate, resume_matches, summary

# one xdist worker runs these tests: its parity runs are also the straight runs of its resume tests (shared_run)
pytestmark = pytest.mark.xdist_group("fsdp")

FLAGS = ["--max_steps", "20", "--eval_every", "10", "--eval_batch_size", "64"]
STEPS = list(range(1, 21))


@pytest.mark.parametrize(
    "nproc, batch, accum, extra",
    [
        (2, 8, 1, []),
        (2, 4, 2, ["--activation_checkpointing"]),
        (4, 4, 1, ["--no-reshard_after_forward"]),
        (4, 2, 2, []),
    ],
)
def test_matches_single_process(nproc, batch, accum, extra, reference, shared_run):
    """Global batch 16 every time; with accumulation the reduce-scatter runs once per step."""
    out = shared_run(
        "train_fsdp.py", nproc, *FLAGS, "--batch_size", str(batch), "--gradient_accumulation_steps", str(accum), *extra
    )
    assert_layout(out, dp_shard=nproc, tp=1, pp=1)
    ref = reference(*FLAGS, "--batch_size", "16")
    assert_matches_reference(ref, out, STEPS)
    if accum > 1:  # one reduce-scatter per FSDP unit (2 blocks + root) per step, not per micro-batch
        assert summary(out)["collectives_first_step_rank0"]["reduce_scatter"]["calls"] == 3


def test_resume_is_exact_and_final_model_evaluates(tmp_path, data_cache, shared_run):
    flags = [*TINY, *FLAGS, "--batch_size", "8", "--data_cache_dir", data_cache]
    # the uninterrupted run: test_matches_single_process's first case
    straight = shared_run("train_fsdp.py", 2, *FLAGS, "--batch_size", "8", "--gradient_accumulation_steps", "1")
    resume_and_evaluate("train_fsdp.py", flags, tmp_path, straight)


def test_checkpoint_of_4_ranks_resumes_on_2(tmp_path, reference, data_cache):
    resume_matches(
        "train_fsdp.py",
        [*TINY, *FLAGS, "--batch_size", "4", "--data_cache_dir", data_cache],
        4,
        tmp_path / "run",
        reference(*FLAGS, "--batch_size", "16"),
        resume_flags=[*TINY, *FLAGS, "--batch_size", "8", "--data_cache_dir", data_cache],
        resume_nproc=2,
        tol=1e-5,
    )
