"""--lora_r (scripts/common/lora.py): LoRA adapters injected by PEFT, the base frozen; every strategy matches
one process step for step; the adapter written as PEFT writes it and read back by PeftModel; checkpoints
hold the adapters only and resume exactly, on another layout too; bad flags refused in one line."""

import sys

import pytest

from conftest import (
    SCRIPTS,
    assert_layout,
    assert_same_losses,
    read_metrics,
    summary,
    train_losses,
)

sys.path.insert(0, str(SCRIPTS))

# one xdist worker: the layouts' runs are launched once, in turn, and shared
pytestmark = pytest.mark.xdist_group("lora")

LORA = ["--lora_r", "4", "--max_steps", "10", "--addition_digits", "4", "--eval_every", "10", "--learning_rate", "1e-2"]
MOE = ["--n_experts", "4", "--top_k", "2"]
LLAMA = ["--model_config", "llama"]
SGD = ["--optimizer", "sgd", "--learning_rate", "0.1", "--max_grad_norm", "0"]
STEPS = list(range(1, 11))
# name: (script, processes, flags beside LORA, the one-process run's flags beside LORA, layout degrees)
LAYOUTS = {
    "ddp": ("train_ddp.py", 2, ["--batch_size", "8"], ["--batch_size", "16"], {}),
    "fsdp": (
        "train_fsdp.py",
        2,
        ["--batch_size", "4", "--gradient_accumulation_steps", "2"],
        ["--batch_size", "16"],
        {"dp_shard": 2},
    ),
    "tp": ("train_tp.py", 2, ["--batch_size", "16"], ["--batch_size", "16"], {"tp": 2}),
    "tp_sequence_parallel": (
        "train_tp.py",
        2,
        ["--batch_size", "16", "--sequence_parallel", "--loss_parallel"],
        ["--batch_size", "16"],
        {"tp": 2},
    ),
    "pp": ("train_pp.py", 2, ["--batch_size", "16"], ["--batch_size", "16"], {"pp": 2}),
    "cp_ring": ("train_cp.py", 2, ["--batch_size", "16"], ["--batch_size", "16"], {"cp": 2}),
    "cp_ulysses": ("train_cp.py", 2, ["--batch_size", "16", "--cp_impl", "ulysses"], ["--batch_size", "16"], {"cp": 2}),
    "ep": ("train_ep.py", 2, ["--batch_size", "8", *MOE], ["--batch_size", "16", *MOE], {"dp_shard": 2}),
    "localsgd": (
        "train_localsgd.py",
        2,
        [*SGD, "--batch_size", "8", "--sync_every", "1"],
        [*SGD, "--batch_size", "16"],
        {},
    ),
    "hybrid_pp_dp_tp": (
        "train_hybrid.py",
        8,
        ["--n_layer", "4", "--batch_size", "8", "--dp_shard", "2", "--pp_size", "2", "--tp_size", "2"],
        ["--n_layer", "4", "--batch_size", "16"],
        {"pp": 2, "dp_shard": 2, "tp": 2},
    ),
    "llama_fsdp": ("train_fsdp.py", 2, ["--batch_size", "8", *LLAMA], ["--batch_size", "16", *LLAMA], {"dp_shard": 2}),
    "llama_tp": ("train_tp.py", 2, ["--batch_size", "16", *LLAMA], ["--batch_size", "16", *LLAMA], {"tp": 2}),
    "llama_pp": ("train_pp.py", 2, ["--batch_size", "16", *LLAMA], ["--batch_size", "16", *LLAMA], {"pp": 2}),
}
RUNS = [(script, nproc, *LORA, *flags) for script, nproc, flags, _, _ in LAYOUTS.values()]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_matches_one_process(name, shared_run, reference):
    """Same losses (within 1e-5) and evaluation as one process with the same adapters."""
    shared_run.in_turn(RUNS)
    script, nproc, flags, ref_flags, degrees = LAYOUTS[name]
    out = shared_run(script, nproc, *LORA, *flags)
    if degrees:
        assert_layout(out, **degrees)
    assert summary(out)["world_size"] == nproc
    ref = reference(*LORA, *ref_flags)
    assert_same_losses(train_losses(ref), train_losses(out), STEPS, tol=1e-5)
    ref_eval, out_eval = (next(r for r in read_metrics(o) if r["type"] == "eval") for o in (ref, out))
    assert abs(ref_eval["eval_loss"] - out_eval["eval_loss"]) < 1e-5
