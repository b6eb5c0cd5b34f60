"""--optimizer muon (scripts/common/muon.py): torch.optim.Muon's update, exact on every layout against one
process (the sharded matrices made whole before Newton–Schulz), resumed exactly and on another layout;
bad flags refused in one line."""

import copy
import sys

import pytest
import torch

from conftest import (
    SCRIPTS,
    TINY,
    assert_layout,
    assert_same_losses,
    local_sgd_reference,
    read_metrics,
    resume_matches,
    run_refused,
    summary,
    train_losses,
)

sys.path.insert(0, str(SCRIPTS))
from common.errors import UsageError
from common.muon import NS_COEFFICIENTS, MuonAdamW, newton_schulz
from common.training import make_optimizer

# one xdist worker: the layouts' runs are launched once, in turn, and shared
pytestmark = pytest.mark.xdist_group("muon")

MUON = ["--optimizer", "muon", "--max_steps", "10", "--addition_digits", "4", "--eval_every", "10"]
MUON += ["--max_eval_samples", "200"]  # the first 200 validation samples: 8 processes on 2 cores evaluate slowly
MOE = ["--n_experts", "4", "--top_k", "2"]
LLAMA = ["--model_config", "llama"]
MIXTRAL = ["--model_config", "mixtral"]  # transformers' Mixtral with small defaults (8 experts, top 2)
STEPS = list(range(1, 11))
# name: (script, processes, flags beside MUON, the one-process run's flags beside MUON, layout degrees)
LAYOUTS = {
    "ddp": ("train_ddp.py", 2, ["--batch_size", "8"], ["--batch_size", "16"], {}),  # no layout record: world_size
    "ddp_accumulation": (
        "train_ddp.py",
        2,
        ["--batch_size", "4", "--gradient_accumulation_steps", "2"],
        ["--batch_size", "16"],
        {},
    ),
    "ddp_3": ("train_ddp.py", 3, ["--batch_size", "4"], ["--batch_size", "12"], {}),
    "fsdp_accumulation": (
        "train_fsdp.py",
        2,
        ["--batch_size", "4", "--gradient_accumulation_steps", "2"],
        ["--batch_size", "16"],
        {"dp_shard": 2},
    ),
    # 3 ranks: 64 rows cut 22, 22, 20 (torch.chunk's rule), the owner's result cut the same way
    "fsdp_uneven": ("train_fsdp.py", 3, ["--batch_size", "4"], ["--batch_size", "12"], {"dp_shard": 3}),
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
    "ep_experts": ("train_ep.py", 2, ["--batch_size", "8", *MOE], ["--batch_size", "16", *MOE], {"dp_shard": 2}),
    "hybrid_fsdp_tp": (
        "train_hybrid.py",
        4,
        ["--n_layer", "4", "--batch_size", "8", "--dp_shard", "2", "--tp_size", "2", "--sequence_parallel"],
        ["--n_layer", "4", "--batch_size", "16"],
        {"dp_shard": 2, "tp": 2},
    ),
    "hybrid_pp_tp": (
        "train_hybrid.py",
        4,
        ["--n_layer", "4", "--batch_size", "16", "--dp_shard", "1", "--pp_size", "2", "--tp_size", "2"],
        ["--n_layer", "4", "--batch_size", "16"],
        {"pp": 2, "tp": 2},
    ),
    "hybrid_pp_dp_tp": (
        "train_hybrid.py",
        8,
        ["--n_layer", "4", "--batch_size", "8", "--dp_shard", "2", "--pp_size", "2", "--tp_size", "2"],
        ["--n_layer", "4", "--batch_size", "16"],
        {"pp": 2, "dp_shard": 2, "tp": 2},
    ),
    # a 🤗 Llama (transformers' config, small defaults): its head found by get_output_embeddings()
    "llama_ddp": ("train_ddp.py", 2, ["--batch_size", "8", *LLAMA], ["--batch_size", "16", *LLAMA], {}),
    "llama_fsdp": ("train_fsdp.py", 2, ["--batch_size", "8", *LLAMA], ["--batch_size", "16", *LLAMA], {"dp_shard": 2}),
    "llama_tp_sequence_parallel": (
        "train_tp.py",
        2,
        ["--batch_size", "16", "--sequence_parallel", *LLAMA],
        ["--batch_size", "16", *LLAMA],
        {"tp": 2},
    ),
    "llama_pp": ("train_pp.py", 2, ["--batch_size", "16", *LLAMA], ["--batch_size", "16", *LLAMA], {"pp": 2}),
    "llama_cp_ring": ("train_cp.py", 2, ["--batch_size", "16", *LLAMA], ["--batch_size", "16", *LLAMA], {"cp": 2}),
    "llama_cp_ulysses": (
        "train_cp.py",
        2,
        ["--batch_size", "16", "--cp_impl", "ulysses", *LLAMA],
        ["--batch_size", "16", *LLAMA],
        {"cp": 2},
    ),
    "llama_hybrid_pp_dp_tp": (
        "train_hybrid.py",
        8,
        ["--batch_size", "8", "--dp_shard", "2", "--pp_size", "2", "--tp_size", "2", *LLAMA],
        ["--batch_size", "16", *LLAMA],
        {"pp": 2, "dp_shard": 2, "tp": 2},
    ),
    # a 🤗 mixture of experts: each expert's matrices (a 3-D stack, cut over ep) orthogonalised where they lie
    "mixtral_ep": (
        "train_ep.py",
        2,
        ["--batch_size", "8", *MIXTRAL],
        ["--batch_size", "16", *MIXTRAL],
        {"dp_shard": 2},
    ),
}
# Local SGD: each replica's inner Muon, fused every 4 steps by DiLoCo's outer Nesterov step. No one-process
# train_ddp.py run computes that; its reference is tests/localsgd_reference.py, the replicas side by side
LOCALSGD = ["--batch_size", "8", "--sync_every", "4", "--outer_optimizer", "nesterov"]
LOCALSGD_RUNS = {"gpt": LOCALSGD, "llama": [*LOCALSGD, *LLAMA]}
RUNS = [(script, nproc, *MUON, *flags) for script, nproc, flags, _, _ in LAYOUTS.values()]
RUNS += [("train_localsgd.py", 2, *MUON, *flags) for flags in LOCALSGD_RUNS.values()]
REFERENCES = [(*MUON, *ref_flags) for _, _, _, ref_flags, _ in LAYOUTS.values()]


def test_newton_schulz_is_torchs_iteration():
    """In bf16, bit for bit torch.optim.Muon's; a stack of matrices (experts) orthogonalised one by one."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    torch.manual_seed(0)
    for shape in [(8, 24), (24, 8), (16, 16)]:
        g = torch.randn(shape)
        assert torch.equal(
            newton_schulz(g, 5, torch.bfloat16), _zeropower_via_newtonschulz(g, NS_COEFFICIENTS, 5, 1e-7)
        )
        stack = torch.randn(3, *shape)
        whole = newton_schulz(stack, 5)
        for i in range(3):
            torch.testing.assert_close(whole[i], newton_schulz(stack[i], 5), rtol=0, atol=1e-6)


def test_step_is_torch_muon_beside_adamw(monkeypatch):
    """Five steps of MuonAdamW = torch.optim.Muon (adjust_lr_fn="match_rms_adamw", its iteration run in fp32
    as ours) on the matrices + torch.optim.AdamW on the rest, to the bit."""
    import torch.optim._muon as torch_muon

    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", lambda g, abc, steps, eps: newton_schulz(g, steps))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    models = [model, copy.deepcopy(model)]
    split = [([p for p in m.parameters() if p.ndim == 2], [p for p in m.parameters() if p.ndim != 2]) for m in models]
    ours = MuonAdamW(
        [{"params": split[0][0], "weight_decay": 0.1, "muon": True}, {"params": split[0][1], "weight_decay": 0.0}],
        lr=1e-2,
    )
    theirs = [
        torch.optim.Muon(split[1][0], lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
        torch.optim.AdamW(split[1][1], lr=1e-2, weight_decay=0.0, betas=(0.9, 0.95)),
    ]
    x = torch.randn(32, 8)
    for _ in range(5):
        for model, optimizers in ((models[0], [ours]), (models[1], theirs)):
            model.zero_grad()
            model(x).pow(2).mean().backward()
            for optimizer in optimizers:
                optimizer.step()
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_model_without_matrices_is_refused():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.LayerNorm(4))
    args = type("Args", (), {"optimizer": "muon", "weight_decay": 0.1, "learning_rate": 1e-3})()
    with pytest.raises(UsageError, match="--optimizer muon: the model has no 2-D weight matrix"):
        make_optimizer(model, args)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_matches_one_process(name, shared_run, reference):
    """Same losses (within 1e-5) and evaluation as one process with Muon: a cut matrix made whole (dealt
    round-robin, or gathered everywhere where two mesh dimensions cut it) is orthogonalised as one."""
    shared_run.in_turn(RUNS)
    reference.in_turn(REFERENCES)  # the one-process runs, in one interpreter
    script, nproc, flags, ref_flags, degrees = LAYOUTS[name]
    out = shared_run(script, nproc, *MUON, *flags)
    if degrees:
        assert_layout(out, **degrees)
    assert summary(out)["world_size"] == nproc
    ref = reference(*MUON, *ref_flags)
    assert_same_losses(train_losses(ref), train_losses(out), STEPS, tol=1e-5)
    ref_eval, out_eval = (next(r for r in read_metrics(o) if r["type"] == "eval") for o in (ref, out))
    assert abs(ref_eval["eval_loss"] - out_eval["eval_loss"]) < 1e-5


@pytest.mark.parametrize("model", list(LOCALSGD_RUNS))
def test_local_sgd_matches_its_replicas_side_by_side(model, shared_run, reference, tmp_path, data_cache):
    """train_localsgd.py on 2 processes (inner Muon, outer Nesterov, fusions at 4, 8 and 10) = its two replicas
    trained in one process on the micro-batches each rank takes, fused the same way: the losses within 1e-5,
    and the fused model's evaluation. Not DDP's: one-process Muon on the whole batch ends elsewhere."""
    shared_run.in_turn(RUNS)
    flags = [*MUON, *LOCALSGD_RUNS[model]]
    out = shared_run("train_localsgd.py", 2, *flags)
    ref_losses, ref_eval = local_sgd_reference(flags, 2, tmp_path, data_cache)
    assert_same_losses(ref_losses, train_losses(out), STEPS, tol=1e-5)
    out_eval = [r for r in read_metrics(out) if r["type"] == "eval"][-1]
    assert out_eval["fused_model"] and abs(out_eval["eval_loss"] - ref_eval) < 1e-5
    ddp = train_losses(reference(*MUON, "--batch_size", "16", *(LLAMA if model == "llama" else [])))
    assert abs(ddp[10] - ref_losses[10]) > 1e-4, (ddp[10], ref_losses[10])


def test_muon_moves_the_loss_differently_from_adamw(shared_run, reference):
    """The flag does something: the same run with AdamW ends elsewhere."""
    muon = train_losses(reference(*MUON, "--batch_size", "16"))
    adamw = train_losses(reference(*[f for f in MUON if f not in ("--optimizer", "muon")], "--batch_size", "16"))
    assert abs(muon[10] - adamw[10]) > 1e-3, (muon[10], adamw[10])


def test_resume_is_exact_and_on_another_layout(shared_run, tmp_path, data_cache):
    """Muon's momentum is saved sharded (FSDP 2) and read back: the resumed run continues the straight
    one within 1e-6, and within 1e-5 when TP 2 resumes it."""
    shared_run.in_turn(RUNS)
    script, nproc, flags, _, _ = LAYOUTS["fsdp_accumulation"]
    straight = shared_run(script, nproc, *MUON, *flags)
    run_flags = [*TINY, *MUON, *flags, "--data_cache_dir", data_cache]
    resume_matches(script, run_flags, nproc, tmp_path / "same", straight, stop=5)
    tp_flags = [*TINY, *MUON, "--batch_size", "16", "--data_cache_dir", data_cache]
    resume_matches(
        script,
        run_flags,
        nproc,
        tmp_path / "tp",
        straight,
        resume_script="train_tp.py",
        resume_flags=tp_flags,
        stop=5,
        tol=1e-5,
    )


BAD = [
    (["--optimizer", "lion"], "--optimizer 'lion' is not supported: use adamw, sgd or muon"),
    (["--optimizer", "muon", "--ns_steps", "0"], "--ns_steps must be at least 1 (got 0)"),
    (["--optimizer", "muon", "--muon_momentum", "1"], "--muon_momentum in [0, 1) (got 1.0)"),
]


def test_bad_flags_are_one_line(tmp_path, data_cache):
    cases = [
        ("train_fsdp.py", [*TINY, *flags, "--data_cache_dir", data_cache, "--output_dir", tmp_path / str(i)])
        for i, (flags, _) in enumerate(BAD)
    ]
    for (_, needle), result in zip(BAD, run_refused(cases), strict=True):
        errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert result.returncode != 0 and len(errors) == 1 and needle in errors[0], result.stderr[-2000:]
