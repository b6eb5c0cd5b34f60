"""train_fsdp.py: FSDP2 (fully_shard) against the single-process run; exact memory accounting."""

import json
import sys

import pytest

from conftest import (
    SCRIPTS,
    TINY,
    assert_layout,
    assert_matches_reference,
    resume_and_evaluate,
    resume_matches,
    summary,
)

sys.path.insert(0, str(SCRIPTS))
import plan_layout

# one xdist worker runs these tests: its parity runs are also the straight runs of its resume tests (shared_run)
pytestmark = pytest.mark.xdist_group("fsdp")

FLAGS = ["--max_steps", "20", "--eval_every", "10", "--eval_batch_size", "64"]
STEPS = list(range(1, 21))


CASES = [
    (2, 8, 1, []),
    (2, 4, 2, ["--activation_checkpointing"]),
    (2, 4, 2, ["--unsharded_accumulation"]),
    (4, 4, 1, ["--no-reshard_after_forward"]),
    (4, 2, 2, []),
]


def parity_run(nproc: int, batch: int, accum: int, extra: list) -> tuple:
    batches = ("--batch_size", str(batch), "--gradient_accumulation_steps", str(accum))
    return ("train_fsdp.py", nproc, *FLAGS, *batches, *extra)


# one launch per process count runs the cases in turn (shared_run.in_turn)
PARITY_RUNS = [parity_run(*case) for case in CASES]


@pytest.mark.parametrize("nproc, batch, accum, extra", CASES)
def test_matches_single_process(nproc, batch, accum, extra, reference, shared_run, monkeypatch, capsys):
    """Global batch 16 every time. With accumulation, gradients stay sharded by default (a reduce-scatter
    per unit and micro-batch); --unsharded_accumulation keeps them whole and reduce-scatters once per step.
    Both match one process, and plan_layout.py plans the collectives the run made."""
    shared_run.in_turn(PARITY_RUNS)
    out = shared_run(*parity_run(nproc, batch, accum, extra))
    assert_layout(out, dp_shard=nproc, tp=1, pp=1)
    ref = reference(*FLAGS, "--batch_size", "16")
    assert_matches_reference(ref, out, STEPS)
    if accum > 1:
        unsharded = "--unsharded_accumulation" in extra
        run = summary(out)
        units = 3  # 2 blocks + the root
        assert run["collectives_first_step_rank0"]["reduce_scatter"]["calls"] == units * (1 if unsharded else accum)
        figures = run["gradient_accumulation"]
        assert figures["gradients"] == ("unsharded" if unsharded else "sharded")
        # no_sync keeps every unit's whole fp32 gradient: the model's, on every rank
        assert figures["unsharded_grad_bytes_per_rank_max"] == (run["unsharded_param_bytes"] if unsharded else 0)
        plan_flags = ["--model_size", "tiny", "--seq_len", "13", "--world_size", str(nproc), "--pp_size", "1"]
        plan_flags += ["--dp_replicate", "1", "--dp_shard", str(nproc), "--tp_size", "1"]
        plan_flags += ["--batch_size", str(batch * accum), "--n_microbatches", str(accum)]
        plan_flags += ["--unsharded_accumulation"] if unsharded else []
        monkeypatch.setattr(sys, "argv", ["plan_layout.py", *plan_flags, "--json"])
        plan_layout.main()
        planned = json.loads(capsys.readouterr().out.strip().splitlines()[-1])[0]["collectives_first_step_rank0"]
        seen = run["collectives_first_step_rank0"]
        assert {k: v["calls"] for k, v in planned.items()} == {k: v["calls"] for k, v in seen.items()}
        for kind, figures in seen.items():
            assert figures["mib"] == pytest.approx(planned[kind]["mib"], abs=1e-4), kind


def test_resume_is_exact_and_final_model_evaluates(tmp_path, data_cache, shared_run):
    flags = [*TINY, *FLAGS, "--batch_size", "8", "--data_cache_dir", data_cache]
    # the uninterrupted run: test_matches_single_process's first case
    shared_run.in_turn(PARITY_RUNS)
    straight = shared_run(*parity_run(2, 8, 1, []))
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
