"""train_cp.py --cp_impl ulysses: context parallelism by all-to-all (DeepSpeed-Ulysses) against the single-process
run: the built-in GPT at cp 2 and 4; 🤗 Llama, and Mistral, Gemma 2 and gpt-oss with their sliding windows,
soft-capping and sinks, with grouped KV heads at cp 2; a ring cp 4 checkpoint continued by Ulysses at cp 2; the
bytes each rank hands to the all-to-alls (counted by the run) against the formula; the attention alone against
causal SDPA (output and q/k/v gradients, head-tail and contiguous chunks, grouped KV heads); heads that cp does
not divide, refused.

Run as a file under torchrun, it is the attention check's worker (test_ulysses_attention_matches_sdpa)."""

import json
import sys

import pytest
from test_bad_input import assert_refused

from conftest import (
    REPO,
    SCRIPTS,
    TINY,
    assert_same_losses,
    evals,
    free_port,
    job_env,
    launch_tiny,
    resume_matches,
    run_cmd,
    run_in_turn,
    summary,
    train_losses,
)

sys.path.insert(0, str(SCRIPTS))
pytestmark = pytest.mark.xdist_group("cp_ulysses")  # the Ulysses runs are launched once, shared by the tests
STEPS = [1, 2, 3, 4]
BATCH = 4  # global batch; one data-parallel rank, so every CP rank reads all of it
SEQ = 64  # tokens per sample (the tiny GPT's context): 64 / cp tokens per rank


def hf_config(folder, model_type: str, **extra):
    """A tiny 🤗 config file (2 layers, 8 query heads, 4 KV heads) of `model_type`."""
    config = {"model_type": model_type, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
    config |= {"num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 64, **extra}
    (folder / f"{model_type}.json").write_text(json.dumps(config))
    return folder / f"{model_type}.json"


def flags(text_files) -> list[str]:
    return [*text_files, "--block_size", str(SEQ), "--max_steps", str(len(STEPS)), "--batch_size", str(BATCH)]


@pytest.fixture(scope="module")
def ulysses_runs(tmp_path_factory, data_cache, text_files):
    """Ulysses runs of the tiny GPT, launched once: runs(cp) -> output directory (one ring of cp processes)."""
    cache = {}

    def run(cp: int):
        if cp not in cache:
            out = tmp_path_factory.mktemp(f"ulysses_cp{cp}") / "run"
            launch_tiny("train_cp.py", out, data_cache, *flags(text_files), "--cp_impl", "ulysses", nproc=cp)
            cache[cp] = out
        return cache[cp]

    return run


def first_step_all_to_all(out) -> dict:
    return summary(out)["collectives_first_step_rank0"]["all_to_all"]


@pytest.mark.parametrize("cp", [2, 4])
def test_ulysses_matches_single_process(cp, text_files, reference, ulysses_runs):
    """The tiny GPT (4 heads, 2 layers, 64 wide), 4 steps of 64-token sequences: the losses and the final
    evaluation of one process within 1e-5; the all-to-all bytes the run counted in its first step (every
    collective, forward and backward: the script's collective counter) are the formula's: per layer q, k, v
    and the output, forward and backward, each a buffer of batch x 64/cp tokens x 64 fp32 values."""
    ref, out = reference(*flags(text_files)), ulysses_runs(cp)
    assert_same_losses(train_losses(ref), train_losses(out), STEPS, 1e-5)
    s = summary(out)
    assert s["layout"]["cp"] == cp and s["cp_impl"] == "ulysses"
    final, final_ref = evals(out)[-1], evals(ref)[-1]  # evaluation: whole sequences, each sample counted once
    assert final["num_samples"] == final_ref["num_samples"] > 0, (final, final_ref)
    assert abs(final["eval_loss"] - final_ref["eval_loss"]) < 1e-5, (final, final_ref)
    from common.sharded_costs import ulysses_bytes_per_layer

    per_layer = ulysses_bytes_per_layer(BATCH, SEQ, cp, 64, 64, 4)
    assert per_layer["forward"] == per_layer["backward"] == 4 * BATCH * (SEQ // cp) * 64 * 4
    step_bytes = (per_layer["forward"] + per_layer["backward"]) * 2  # 2 layers
    counted = first_step_all_to_all(out)
    assert counted == {"calls": 8 * 2, "mib": round(step_bytes / 2**20, 4)}, counted
    assert s["all_to_all_mib_per_step_rank"] == s["all_to_all_formula_mib_per_step_rank"]
    assert s["all_to_all_formula_mib_per_step_rank"]["forward"] == round(per_layer["forward"] * 2 / 2**20, 4)


# the 🤗 families' masks: Mistral's window (8 tokens on 16-token rows), Gemma 2's soft-capped scores (2.0, so the
# cap bites) on sliding and full layers with its own score scale, gpt-oss's sinks on sliding and full layers
MASKED = {
    "mistral": {"sliding_window": 8},
    "gemma2": {"head_dim": 8, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}
    | {"query_pre_attn_scalar": 16, "attn_logit_softcapping": 2.0},
    "gpt_oss": {"head_dim": 8, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}
    | {"num_local_experts": 4, "num_experts_per_tok": 2},
}


def test_hf_families_and_their_masks_match_single_process(tmp_path, data_cache):
    """Tiny 🤗 models (8 query heads, 4 KV heads, rotary positions) at cp 2 through transformers'
    AttentionInterface, 4 steps of 16-token addition rows (answers of unequal length), within 1e-5 of one
    process: Llama (its all-to-all bytes as counted match the formula: the KV heads arrive repeated to 8) and
    the families that declare masks (MASKED), under Ulysses; Gemma 2's soft-capping under the ring too (the
    zoo, tests/test_hf_zoo.py, runs the ring on Mistral's, Gemma 3's and gpt-oss's); Mistral's ring at cp 4,
    on contiguous chunks of 4 tokens, where the 8-token window ends the ring after 3 of its 4 steps: the
    bytes sent are the formula's and the summary gives those not sent. One launch per process count, the
    runs in turn."""
    common = [*TINY, "--max_steps", "4", "--addition_digits", "4", "--eval_batch_size", "500", "--batch_size", "16"]
    common += ["--data_cache_dir", data_cache]
    configs = {"llama": hf_config(tmp_path, "llama")}
    configs |= {name: hf_config(tmp_path, name, **extra) for name, extra in MASKED.items()}
    runs = [(name, "ulysses") for name in configs] + [("gemma2", "ring")]

    def case(script, name, out, *extra):
        return [
            str(SCRIPTS / script),
            [*common, "--model_config", str(configs[name]), "--output_dir", str(out), *extra],
        ]

    ones = [case("train_ddp.py", name, tmp_path / f"one_{name}") for name in configs]
    cps = [case("train_cp.py", name, tmp_path / f"{impl}_{name}", "--cp_impl", impl) for name, impl in runs]
    cp4 = [case("train_cp.py", "mistral", tmp_path / "ring4_mistral")]  # contiguous chunks of 4: 3 of 4 steps
    results = run_in_turn(ones, 1, tmp_path / "one") + run_in_turn(cps, 2, tmp_path / "cp2")
    results += run_in_turn(cp4, 4, tmp_path / "cp4")
    for result in results:
        assert result["returncode"] == 0, result["stderr"][-3000:]
    for name, impl in [*runs, ("mistral", "ring4")]:
        ref, got = train_losses(tmp_path / f"one_{name}"), train_losses(tmp_path / f"{impl}_{name}")
        assert_same_losses(ref, got, STEPS, 1e-5)
    ring4 = summary(tmp_path / "ring4_mistral")  # the window ends the ring after 3 of its 4 steps: sent as said
    assert ring4["ring_mib_per_step_rank"] == ring4["ring_formula_mib_per_step_rank"], ring4
    assert ring4["ring_not_sent_by_windows_mib_per_step_rank"] > 0, ring4
    assert "the ring stops after 3 of 4 steps there" in results[-1]["stdout"], results[-1]["stdout"][-2000:]
    from common.sharded_costs import ulysses_bytes_per_layer

    per_layer = ulysses_bytes_per_layer(16, 16, 2, 64, 64, 4)
    step_mib = round((per_layer["forward"] + per_layer["backward"]) * 2 / 2**20, 4)
    assert first_step_all_to_all(tmp_path / "ulysses_llama") == {"calls": 16, "mib": step_mib}


def test_ring_cp4_checkpoint_continues_as_ulysses_cp2(tmp_path, text_files, data_cache, ulysses_runs):
    """Saved by the ring at cp 4 after step 2, continued by Ulysses at cp 2: steps 3 and 4 are the
    uninterrupted Ulysses cp 2 run's within 1e-5 (itself one process's within 1e-5)."""
    base = [*TINY, *flags(text_files), "--data_cache_dir", data_cache]
    resume_matches(
        "train_cp.py",
        base,
        4,
        tmp_path / "run",
        ulysses_runs(2),
        resume_flags=[*base, "--cp_impl", "ulysses"],
        resume_nproc=2,
        stop=2,
        tol=1e-5,
    )


def test_heads_that_cp_does_not_divide_are_refused(tmp_path, text_files, data_cache):
    """3 heads (--n_embd 48 --n_head 3) at cp 2: one error line naming --cp_size, --cp_impl and the heads,
    before anything is written."""
    out = tmp_path / "run"
    args = [*flags(text_files), "--cp_impl", "ulysses", "--n_embd", "48", "--n_head", "3"]
    result = launch_tiny("train_cp.py", out, data_cache, *args, nproc=2, check=False)
    assert_refused(
        result,
        "--cp_size 2 --cp_impl ulysses cuts the attention heads over 2 ranks, but the model has 3 query heads",
        "use a --cp_size that divides the heads, or --cp_impl ring",
    )
    assert not out.exists() or not any(out.iterdir()), "a refused run wrote output"


def test_ulysses_attention_matches_sdpa():
    """One 4-process launch (this file as the worker): Ulysses over 2 ranks (two groups at once) and over 4,
    with contiguous and with head-tail chunks (the all-to-all brings them in rank order: they are put back
    in the sequence's), 8 query heads with 8 and with 4 K/V heads: the output and the gradients of q, k and
    v equal causal SDPA's on the whole sequence within 1e-6; the buffers sent are the formula's."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port", str(free_port())]
    result = run_cmd([*cmd, __file__], env=job_env(), timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert len(results) == 8, results
    for name, r in results.items():
        assert r["max_error"] < 1e-6, (name, r)
        assert r["sent"] == r["formula"], (name, r)


def attention_check() -> None:
    """The worker of test_ulysses_attention_matches_sdpa (every rank of a torchrun launch of 4)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from train_cp import ulysses_attention

    from common.context_parallel import contiguous_chunks, head_tail_chunks, rank_positions
    from common.cp_comms import Ulysses

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
    groups = {2: pairs[rank // 2], 4: dist.new_group([0, 1, 2, 3])}
    B, H, T, D = 2, 8, 48, 8
    results = {}
    for cp, group in groups.items():
        for order, chunks_of in (("contiguous", contiguous_chunks(cp)), ("head_tail", head_tail_chunks(cp))):
            for kv_heads in (8, 4):
                torch.manual_seed(0)  # the same whole sequence on every rank
                q = torch.randn(B, H, T, D, requires_grad=True)
                k, v = (torch.randn(B, kv_heads, T, D, requires_grad=True) for _ in range(2))
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != H)
                grad_out = torch.randn_like(out)
                out.backward(grad_out)
                cp_rank = dist.get_rank(group)
                mine = rank_positions(T, chunks_of[cp_rank], sum(map(len, chunks_of)))
                local = [t.detach()[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
                ulysses = Ulysses(group, chunks_of)
                local_out = ulysses_attention(ulysses)(*local)
                local_out.backward(grad_out[:, :, mine])
                errors = [(local_out - out[:, :, mine]).abs().max().item()]
                errors += [(a.grad - b.grad[:, :, mine]).abs().max().item() for a, b in zip(local, (q, k, v))]
                one = B * (T // cp) * D * 4  # bytes per head of a rank's buffer
                formula = one * (H + 2 * kv_heads + H)
                results[f"cp{cp}_{order}_kv{kv_heads}"] = {
                    "max_error": max(errors),
                    "sent": ulysses.sent_bytes,
                    "formula": {"forward": formula, "backward": formula},
                }
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, results)
    if rank == 0:
        merged = {}
        for r in every:
            for name, value in r.items():
                worst = merged.get(name)
                if worst is None or value["max_error"] > worst["max_error"]:
                    merged[name] = value
        print("RESULT " + json.dumps(merged))
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(REPO / "scripts"))
    attention_check()
