"""train_ep.py: expert parallelism (all-to-all routing) against the one-process MoE run of train_ddp.py,
with both balancing kinds; the first step's routing on every rank, token by token; a checkpoint of ep 4
resumed at ep 2; and the bad input it refuses before any process group exists."""

import json
import sys

import pytest
import torch

from conftest import (
    SCRIPTS,
    TINY,
    assert_layout,
    assert_matches_reference,
    launch,
    launch_tiny,
    read_metrics,
    run_in_turn,
    run_refused,
    train_losses,
)

# one xdist worker runs these tests: the runs are launched once and shared (module fixture below)
pytestmark = pytest.mark.xdist_group("ep")

STEPS = list(range(1, 7))
# 4 experts, top-2; a bias step far above the default 1e-3, so that a bias updated from one rank's
# counts instead of the global batch's would change the routing, and the losses, within 6 steps
MOE = ["--max_steps", "6", "--n_experts", "4", "--top_k", "2", "--eval_batch_size", "100"]
AUX_FREE = [*MOE, "--load_balance", "aux_free", "--bias_update_rate", "0.05"]
AUX_LOSS = [*MOE, "--load_balance", "aux_loss", "--aux_loss_coef", "0.1"]
GLOBAL_BATCH = 16

# name: (script, processes, balancing flags, layout flags)
RUNS = {
    "ref_aux_free": ("train_ddp.py", 1, AUX_FREE, ["--batch_size", "16"]),
    "ref_aux_loss": ("train_ddp.py", 1, AUX_LOSS, ["--batch_size", "16"]),
    "ep1_aux_free": ("train_ep.py", 1, AUX_FREE, ["--batch_size", "16"]),  # every expert local
    "ep2_aux_free": ("train_ep.py", 2, AUX_FREE, ["--batch_size", "8"]),
    "ep4_aux_free": ("train_ep.py", 4, AUX_FREE, ["--batch_size", "4", "--checkpoint_every", "3"]),
    # ep 2 on 4 processes: each group of 2 computes the experts, which FSDP cuts again over the 2 groups; accumulation
    "ep2x2_aux_loss": (
        "train_ep.py",
        4,
        AUX_LOSS,
        ["--batch_size", "2", "--gradient_accumulation_steps", "2", "--ep_size", "2"],
    ),
    "ep4_aux_loss": ("train_ep.py", 4, AUX_LOSS, ["--batch_size", "4"]),
    "fsdp2_aux_free": ("train_fsdp.py", 2, AUX_FREE, ["--batch_size", "8"]),  # experts sharded like the rest
}


@pytest.fixture(scope="module")
def run(tmp_path_factory, data_cache):
    """run(name) -> its output directory. The first call launches every run, those of one process count in
    one launch, in turn (run_in_turn); every run dumps its first step's routing beside its output."""
    done = {}

    def get(name: str):
        if not done:
            for nproc in sorted({n for _, n, _, _ in RUNS.values()}):
                names = [k for k, (_, n, _, _) in RUNS.items() if n == nproc]
                cases = []
                for key in names:
                    script, _, balance, layout = RUNS[key]
                    done[key] = out = tmp_path_factory.mktemp(key) / "run"
                    args = [*TINY, *balance, *layout, "--dump_routing", str(out.parent / "routing")]
                    args += ["--data_cache_dir", data_cache, "--output_dir", str(out)]
                    cases.append([str(SCRIPTS / script), args])
                results = run_in_turn(cases, nproc, tmp_path_factory.mktemp(f"in_turn_{nproc}"))
                for key, result in zip(names, results, strict=True):
                    assert result["returncode"] == 0, f"{key}: exit {result['returncode']}\n{result['stderr']}"
        return done[name]

    return get


@pytest.mark.parametrize(
    "name, ep, slices",
    [
        ("ep1_aux_free", 1, 1),
        ("ep2_aux_free", 2, 1),
        ("ep4_aux_free", 4, 1),
        ("ep2x2_aux_loss", 2, 2),
        ("ep4_aux_loss", 4, 1),
    ],
)
def test_matches_one_process(name, ep, slices, run):
    """Same per-step loss (within 1e-5) and final evaluation as the one-process MoE run."""
    out = run(name)
    balance = "aux_free" if "aux_free" in name else "aux_loss"
    assert_matches_reference(run(f"ref_{balance}"), out, STEPS)
    assert_layout(out, dp_shard=ep, dp_replicate=slices)
    records = [r for r in read_metrics(out) if r["type"] == "train"]
    assert all(r["ep"] == ep and len(r["expert_load"]) == 2 for r in records)
    summary = next(r for r in read_metrics(out) if r["type"] == "summary")
    # each rank computes E / ep experts and keeps 1 / (dp / ep) of them (FSDP over the groups of ep ranks):
    # 2 layers x (up + down) x 64 x 128 floats per expert; at ep 2 on 4 processes, 4 / 2 / 2 experts' worth
    assert summary["expert_param_bytes_per_rank"] == 2 * 2 * (4 // ep / slices) * 64 * 128 * 4
    accumulation = 2 if "ep2x2" in name else 1
    # per MoE layer and micro-batch: dispatch + combine, forward + backward (one process: nothing is sent)
    all_to_all = summary["collectives_first_step_rank0"].get("all_to_all", {"calls": 0})
    assert all_to_all["calls"] == (2 * 2 * 2 * accumulation if ep > 1 else 0)


def test_fsdp_trains_the_same_moe_model(run):
    """train_fsdp.py takes the MoE flags too (the experts' (E, ...) tensors sharded like any parameter):
    the same losses, the same bias update over all processes."""
    assert_matches_reference(run("ref_aux_free"), run("fsdp2_aux_free"), STEPS)


@pytest.mark.parametrize("name", ["ep2_aux_free", "ep4_aux_free"])
def test_first_step_routing_equals_one_process(name, run):
    """Every rank's expert choices for its samples of step 1 equal the one-process run's for the same
    samples (rank r holds samples r*b .. (r+1)*b - 1 of the global batch), token by token, in every layer."""
    ref_routing, routing = run("ref_aux_free").parent / "routing", run(name).parent / "routing"
    nproc = RUNS[name][1]
    per_rank = GLOBAL_BATCH // nproc
    for layer in ("blocks.0", "blocks.1"):
        ref = torch.load(ref_routing / f"rank0_{layer}.pt")
        assert ref.shape == (GLOBAL_BATCH, 13, 2)
        for rank in range(nproc):
            mine = torch.load(routing / f"rank{rank}_{layer}.pt")
            assert torch.equal(mine, ref[rank * per_rank : (rank + 1) * per_rank]), (layer, rank)


def test_checkpoint_of_ep4_resumes_at_ep2(run, data_cache, tmp_path):
    """ep 4's checkpoint of step 3 (4 experts cut in 4, DTensor Shard(0) under full names) continues on 4
    processes at ep 2 (2 experts per group of 2, each cut again in 2 along dim 1) and gives the uninterrupted
    run's losses, as it does on one process; its exported model loads in evaluate.py."""
    ep4 = run("ep4_aux_free")
    out = tmp_path / "resumed"
    checkpoint = ep4 / "checkpoints" / "step_3"
    flags = [*AUX_FREE, "--batch_size", "4", "--ep_size", "2", "--resume_from_checkpoint", str(checkpoint)]
    launch_tiny("train_ep.py", out, data_cache, *flags, nproc=4)
    straight, resumed = train_losses(ep4), train_losses(out)
    assert sorted(resumed) == [4, 5, 6]
    assert all(abs(straight[s] - resumed[s]) <= 1e-5 for s in (4, 5, 6)), (straight, resumed)
    # and on one process, where every expert is local
    alone = tmp_path / "alone"
    flags = [*AUX_FREE, "--batch_size", "16", "--resume_from_checkpoint", str(checkpoint)]
    launch_tiny("train_ep.py", alone, data_cache, *flags, nproc=1)
    resumed_alone = train_losses(alone)
    assert all(abs(straight[s] - resumed_alone[s]) <= 1e-5 for s in (4, 5, 6)), (straight, resumed_alone)
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["n_experts"] == 4 and config["load_balance"] == "aux_free"
    result = tmp_path / "eval.json"
    launch("evaluate.py", ["--model_dir", str(out / "model"), "--output_file", str(result)])
    final = [r for r in read_metrics(out) if r["type"] == "eval"][-1]
    assert abs(json.loads(result.read_text())["eval_loss"] - final["eval_loss"]) < 1e-5


def test_plan_layout_matches_the_ep_runs(run, monkeypatch, capsys):
    """plan_layout.py --n_experts: expert bytes per rank (E / ep experts, cut again over dp / ep) exactly as
    measured at ep 4 and at ep 2 on 4 processes, the total parameters, fewer active than total, and the
    all-to-all bytes of the first step on rank 0 against
    tokens x top_k x n_embd x 4 bytes x 2 (dispatch, combine) x 2 (forward, backward) x MoE layers: rank 0
    sends its own tokens' copies but receives however many the router sent to its expert (+-50%)."""
    sys.path.insert(0, str(SCRIPTS))
    import plan_layout

    monkeypatch.setattr(sys, "argv", ["plan_layout.py", "--model_size", "tiny", "--world_size", "4", "--json"])
    monkeypatch.setattr(sys, "argv", [*sys.argv, "--n_experts", "4", "--top_k", "2", "--batch_size", "4"])
    monkeypatch.setattr(sys, "argv", [*sys.argv, "--seq_len", "13"])
    plan_layout.main()
    plans = {p["ep"]: p for p in json.loads(capsys.readouterr().out.strip().splitlines()[-1])}
    assert sorted(plans) == [1, 2, 4]
    for ep, name in ((4, "ep4_aux_free"), (2, "ep2x2_aux_loss")):
        measured = next(r for r in read_metrics(run(name)) if r["type"] == "summary")
        assert plans[ep]["expert_param_bytes_per_rank"] == measured["expert_param_bytes_per_rank"], ep
    plan = plans[4]
    measured = next(r for r in read_metrics(run("ep4_aux_free")) if r["type"] == "summary")
    assert plan["total_params"] == measured["n_params"] > plan["active_params_per_token"]
    assert plan["all_to_all_bytes_per_step_rank"] == 4 * 13 * 2 * 64 * 4 * 2 * 2 * 2
    a2a = measured["collectives_first_step_rank0"]["all_to_all"]["mib"] * 2**20
    assert 0.5 < a2a / plan["all_to_all_bytes_per_step_rank"] < 1.5, a2a


def test_expert_bias_is_saved_and_moves(run):
    """The aux-loss-free bias is a buffer of the exported model, and it moved (6 steps of 0.05)."""
    from safetensors.torch import load_file

    weights = load_file(str(run("ep4_aux_free") / "model" / "model.safetensors"))
    bias = weights["blocks.0.mlp.expert_bias"]
    assert bias.shape == (4,) and bias.abs().max() > 0.04
    assert weights["blocks.0.mlp.experts.up_proj"].shape == (4, 64, 128)  # the full tensor, not a shard


BAD_INPUT = [
    (["--n_experts", "6", "--ep_size", "4"], ["--n_experts 6 is not divisible by --ep_size 4", "multiple of 4"]),
    (["--n_experts", "4", "--top_k", "5"], ["--top_k 5 with --n_experts 4", "1 <= top_k <= n_experts"]),
    (["--n_experts", "4", "--ep_size", "3"], ["--ep_size 3 does not divide the 4 data-parallel processes"]),
    (["--n_experts", "0"], ["--n_experts 0: expert parallelism cuts the experts", "train_fsdp.py"]),  # a dense model
]


def test_bad_input_is_one_line(tmp_path):
    """E not divisible by ep, top_k > E, ep not dividing the data-parallel degree, no experts at all:
    checked from the flags and the launcher's WORLD_SIZE before any process group exists, so each gives
    one `error:` line with the fix, exit 2, nothing written (a 4-process launch fails the same way). The four run in one
    interpreter, one after the other, each as `python scripts/train_ep.py` with WORLD_SIZE=4."""
    cases = [
        ("train_ep.py", [*TINY, *flags, "--output_dir", tmp_path / str(i)], {"WORLD_SIZE": "4"})
        for i, (flags, _) in enumerate(BAD_INPUT)
    ]
    results = run_refused(cases)
    for i, ((_, needles), result) in enumerate(zip(BAD_INPUT, results, strict=True)):
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert result.returncode == 2 and len(errors) == 1, result.stderr[-2000:]
        assert all(n in errors[0] for n in needles), errors[0]
        assert not (tmp_path / str(i)).exists() and "Traceback" not in result.stderr
