"""--compile (torch.compile per transformer block) matches the eager single-process run.

Compiled kernels reorder floating-point work (fused reductions, other matmul paths), so the
tolerance is 2e-3 instead of the 1e-5 of the eager parity tests. The first compilation on a CPU
takes a minute; the later ones reuse torch's on-disk cache (same block, same shapes), so the
tests share their shapes: a per-rank micro-batch of 8 (the evaluation's too) on 4-digit
addition."""

import pytest

from conftest import TINY, assert_same_losses, launch, read_metrics, summary, train_losses

STEPS = 6
# the single-process reference: global batch 16
REFERENCE = ["--max_steps", str(STEPS), "--addition_digits", "4", "--batch_size", "16", "--eval_batch_size", "8"]


@pytest.mark.parametrize(
    "script, extra",
    [
        ("train_ddp.py", ["--batch_size", "8"]),  # 2 data-parallel ranks x 8
        ("train_fsdp.py", ["--batch_size", "8"]),
        ("train_tp.py", ["--eval_batch_size", "16"]),  # one TP group: the whole batch
        ("train_pp.py", ["--n_microbatches", "2"]),  # one pipeline: 2 micro-batches of 8
    ],
)
def test_compile_matches_eager(script, extra, reference, tmp_path, data_cache):
    out = tmp_path / "compiled"
    result = launch(
        script,
        [*TINY, *REFERENCE, *extra, "--compile", "--data_cache_dir", data_cache, "--output_dir", str(out)],
        nproc=2,
    )
    # the user is told that compilation is under way, and what the first step cost
    assert "--compile: compiling the 2 repeated unit(s)" in result.stdout or "--compile: compiling the 1" in (
        result.stdout
    ), result.stdout[-2000:]
    assert "torch.compile's compilation included" in result.stdout + result.stderr
    assert summary(out)["compiled_graphs"] >= 1  # it really compiled: not a silent fallback to eager
    ref = reference(*REFERENCE)
    assert_same_losses(train_losses(ref), train_losses(out), list(range(1, STEPS + 1)), tol=2e-3)
    (final,) = [r for r in read_metrics(out) if r["type"] == "eval"]
    (ref_final,) = [r for r in read_metrics(ref) if r["type"] == "eval"]
    assert final["num_samples"] == 1000 and abs(final["eval_loss"] - ref_final["eval_loss"]) < 2e-3
