"""train_cp.py: context parallelism (ring attention, head-tail balancing) against the single-process run;
the ring alone against SDPA; the attention blocks per rank; resume across cp degrees; bad input."""

import json
import shutil
import sys
from pathlib import Path

import pytest
from test_bad_input import assert_refused

from conftest import (
    REPO,
    SCRIPTS,
    TINY,
    assert_same_losses,
    free_port,
    job_env,
    launch,
    launch_tiny,
    resume_matches,
    run_cmd,
    run_refused,
    summary,
    train_losses,
)

sys.path.insert(0, str(REPO / "scripts"))
from common.context_parallel import blocks_per_rank, contiguous_chunks, head_tail_chunks

# one xdist worker runs the parity tests: the cp 4 run is also the straight run of the resume test (shared_run)
MAX_STEPS = 6
STEPS = list(range(1, MAX_STEPS + 1))


def flags(text_files, batch_size: int) -> list[str]:
    return [*text_files, "--block_size", "256", "--max_steps", str(MAX_STEPS), "--batch_size", str(batch_size)]


def final_eval(out) -> dict:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"eval"' in line][-1]


def assert_matches(ref, out) -> None:
    a, b = train_losses(ref), train_losses(out)
    assert sorted(a) == sorted(b) == STEPS, (sorted(a), sorted(b))
    worst = max(STEPS, key=lambda s: abs(a[s] - b[s]))
    assert abs(a[worst] - b[worst]) <= 1e-5, f"step {worst}: {a[worst]} vs {b[worst]}"
    ea, eb = final_eval(ref), final_eval(out)  # evaluation: whole sequences, each sample counted once
    assert ea["num_samples"] == eb["num_samples"] == 8 and abs(ea["eval_loss"] - eb["eval_loss"]) < 1e-5, (ea, eb)


@pytest.mark.xdist_group("cp")
@pytest.mark.parametrize(
    "nproc, batch, extra, cp, dp",
    [(2, 4, [], 2, 1), (4, 4, [], 4, 1), (4, 2, ["--cp_size", "2"], 2, 2)],
    ids=["cp2", "cp4", "dp2_cp2"],
)
def test_matches_single_process(nproc, batch, extra, cp, dp, text_files, reference, shared_run):
    """Global batch 4 of 256-token sequences; dp 2 x cp 2 shards the data over dp only, FSDP over all 4."""
    out = shared_run("train_cp.py", nproc, *flags(text_files, batch), *extra)
    assert_matches(reference(*flags(text_files, 4)), out)
    s = summary(out)
    assert s["layout"] == {"pp": 1, "dp_replicate": 1, "dp_shard": dp, "cp": cp, "tp": 1}
    # bytes each rank sent around the ring per step, against (cp-1) K/V blocks per layer forward, and
    # (cp-1) K/V + cp dK/dV blocks per layer backward
    assert s["ring_mib_per_step_rank"] == s["ring_formula_mib_per_step_rank"]
    kv_block_mib = 2 * batch * (256 // cp) * 64 * 4 / 2**20
    assert s["ring_formula_mib_per_step_rank"]["forward"] == round((cp - 1) * kv_block_mib * 2, 4)
    assert s["ring_formula_mib_per_step_rank"]["backward"] == round((2 * cp - 1) * kv_block_mib * 2, 4)


def test_hybrid_tp2_cp2_matches_single_process(text_files, reference, tmp_path, data_cache):
    """train_hybrid.py --tp_size 2 --cp_size 2: TP, then the ring over the CP pairs (local heads), FSDP over cp."""
    out = tmp_path / "run"
    launch_tiny("train_hybrid.py", out, data_cache, *flags(text_files, 4), "--tp_size", "2", "--cp_size", "2", nproc=4)
    assert_matches(reference(*flags(text_files, 4)), out)
    assert summary(out)["layout"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 2, "tp": 2}


@pytest.mark.xdist_group("cp")
def test_checkpoint_of_cp4_resumes_on_cp2(tmp_path, text_files, data_cache, shared_run):
    straight = shared_run("train_cp.py", 4, *flags(text_files, 4))  # test_matches_single_process's cp4
    resume_matches(
        "train_cp.py",
        [*TINY, *flags(text_files, 4), "--data_cache_dir", data_cache],
        4,
        tmp_path / "run",
        straight,
        resume_nproc=2,
        stop=3,
        tol=1e-5,
    )


def test_ring_matches_sdpa_and_head_tail_balances():
    """One 4-process launch: rings of 2, 3 and 4 ranks (sub-groups), each with head-tail and with
    contiguous chunks: output and the gradients of q, k, v equal causal SDPA's within 1e-5, and the
    attention blocks each rank computed are those blocks_per_rank counts. With the masks (rings of 2 and 4):
    sliding windows of 5, 24 and 60 tokens (smaller than, equal to and larger than a chunk), sinks (and
    their gradient), soft-capped scores, packed documents across chunk borders (alone, in a window, with sinks
    and soft-capping; short ones that leave blocks empty), each against the scores written out within 1e-5; a
    window or short documents skip
    blocks, and on contiguous chunks at cp 4 a 5-token window ends the ring after 2 of its 4 steps: a
    third of the forward bytes, every rank's bytes those of ring_bytes_per_step's formula."""
    port = str(free_port())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port", port]
    result = run_cmd([*cmd, str(REPO / "tests" / "cp_ring_check.py")], env=job_env(), timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))[7:])
    for cp in (2, 3, 4):
        balanced, unbalanced = results[f"{cp}_head_tail"], results[f"{cp}_contiguous"]
        assert balanced["max_error"] < 1e-5 and unbalanced["max_error"] < 1e-5, (cp, results)
        assert balanced["blocks_per_rank"] == blocks_per_rank(head_tail_chunks(cp))
        assert unbalanced["blocks_per_rank"] == blocks_per_rank(contiguous_chunks(cp))
    masked = {name: r for name, r in results.items() if name.count("_") > 1 and not name.endswith("head_tail")}
    assert len(masked) == 2 * 2 * 11, sorted(results)
    for name, r in masked.items():
        assert r["max_error"] < 1e-5, (name, r)
        assert all(sent == r["formula"] for sent in r["sent_per_rank"]), (name, r)
        skips = "window" in name or "short_documents" in name  # blocks a mask leaves empty are not computed
        assert skips == (sum(r["skipped_per_rank"]) > 0) or "contiguous" in name, (name, r)
    full, windowed = results["4_contiguous"]["formula"], results["4_contiguous_window5"]["formula"]
    assert windowed["forward"] * 3 == full["forward"] and sum(results["4_head_tail_window5"]["skipped_per_rank"]) == 21


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_blocks_per_rank_with_and_without_head_tail(cp):
    """Causal attention, counted in (q chunk x kv chunk) blocks: with head-tail every rank computes
    2cp + 1 of the (2cp)(2cp+1)/2 blocks (spread 0, at most 1); cut into cp contiguous chunks, rank r
    computes r + 1 of the W = cp blocks of the last row (spread W - 1: rank W-1 does W times rank 0's work)."""
    balanced, unbalanced = blocks_per_rank(head_tail_chunks(cp)), blocks_per_rank(contiguous_chunks(cp))
    assert max(balanced) - min(balanced) <= 1 and sum(balanced) == (2 * cp) * (2 * cp + 1) // 2
    assert unbalanced == list(range(1, cp + 1)) and max(unbalanced) == cp * min(unbalanced)


def test_bad_input_is_refused_with_one_line(tmp_path, text_files, data_cache):
    """cp not dividing the processes (one process asked for --cp_size 2), and a sequence length that 2 x cp
    does not divide (254 tokens, cp 2: 4 chunks): one error line each, nothing written."""
    out = tmp_path / "run"
    common = [*TINY, *flags(text_files, 4), "--data_cache_dir", data_cache, "--output_dir", out]
    (cp2,) = run_refused([("train_cp.py", [*common, "--cp_size", "2"])])  # one process, in this interpreter
    assert_refused(cp2, "--cp_size 2 does not divide the 1 processes", "use a --cp_size that divides 1")
    args = [*flags(text_files, 4), "--block_size", "254"]
    result = launch_tiny("train_cp.py", out, data_cache, *args, nproc=2, check=False)
    assert_refused(
        result,
        "--cp_size 2 cuts each 254-token sequence into 2 x cp = 4 chunks",
        "use a --block_size divisible by 4",
    )
    assert not out.exists() or not any(out.iterdir()), "a refused run wrote output"


def own_model_copy(tmp_path, then: str = ""):
    """A copy of common/ and train_cp.py alone (no sibling lesson), whose train_cp.py builds
    tests/cp_own_model/own_model.py's model in its MODEL section (then runs the lines `then`); returns
    the copy's folder."""
    copy = tmp_path / "scripts"
    shutil.copytree(SCRIPTS / "common", copy / "common")
    shutil.copy(Path(__file__).with_name("cp_own_model") / "own_model.py", copy / "own_model.py")
    text = (SCRIPTS / "train_cp.py").read_text()
    line = "    model, task = language_model(args, data)\n"
    assert text.count(line) == 1
    (copy / "train_cp.py").write_text(
        text.replace(line, "    from own_model import build\n\n    model, task = build(data)\n" + then)
    )
    return copy


def test_a_model_of_your_own_needs_only_the_two_methods(tmp_path, data_cache):
    """A copy of train_cp.py whose MODEL section builds a model of one's own (tests/cp_own_model/own_model.py:
    no GPTConfig, no 🤗 config; its Task implements set_attention and forward_at, nothing else of CP):
    cp 2 on 2 processes matches its one-process run within 1e-5, and the ring's bytes, measured from the
    model through the contract, are the summary's."""
    copy = own_model_copy(tmp_path)
    runs = {}
    for nproc in (1, 2):
        runs[nproc] = tmp_path / f"run{nproc}"
        args = [
            "--addition_digits",
            "4",
            "--max_steps",
            "6",
            "--batch_size",
            "8",
            "--eval_every",
            "0",
            "--log_every",
            "1",
        ]
        launch(
            str(copy / "train_cp.py"),
            [*args, "--data_cache_dir", data_cache, "--output_dir", str(runs[nproc])],
            nproc=nproc,
        )
    assert_same_losses(train_losses(runs[1]), train_losses(runs[2]), range(1, 7), 1e-5)
    s = summary(runs[2])
    assert (
        s["ring_mib_per_step_rank"] == s["ring_formula_mib_per_step_rank"]
        and s["ring_mib_per_step_rank"]["forward"] > 0
    )


def test_a_task_without_the_loss_of_some_tokens_is_refused(tmp_path, data_cache):
    """docs/cp.md lists what CP needs of a model of one's own: set_attention, forward_at, and the loss of
    some tokens of each sequence (next_token_targets, loss_at: CausalLMTask's). A Task without them is one
    line before step 1, not a traceback."""
    copy = own_model_copy(tmp_path, "    task.loss_at = None\n")
    args = ["--addition_digits", "4", "--max_steps", "2", "--batch_size", "8", "--cp_size", "2"]
    out = tmp_path / "run"
    result = launch(
        str(copy / "train_cp.py"), [*args, "--data_cache_dir", data_cache, "--output_dir", str(out)], 2, check=False
    )
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and len(errors) == 1, result.stderr[-3000:]
    assert errors[0].startswith("error: --cp_size: the Task has no loss_at"), errors[0]
