"""plan_layout.py: the plan against real runs (state bytes, first-step collectives, pipeline
activations), and the planner's own promises: every valid layout, fits or not, --json, --network,
one-line errors."""

import json
import math
import re
import sys
import time

import pytest

from conftest import REPO, SCRIPTS, TINY, launch_tiny, run_cmd, run_in_turn, summary

sys.path.insert(0, str(SCRIPTS))
import plan_layout
import test_fsdp
import test_tp

from common.launch import run_main

NETWORK = REPO / "tests" / "data" / "preflight_2nodes.json"


def plan(monkeypatch, capsys, *flags: str) -> list[dict]:
    """Run the planner in this process (torch is imported once) and return its --json records."""
    monkeypatch.setattr(sys, "argv", ["plan_layout.py", *flags, "--json"])
    plan_layout.main()
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def usage_error(monkeypatch, capsys, *flags: str) -> str:
    """The planner's exit code 2 and its one stderr line."""
    monkeypatch.setattr(sys, "argv", ["plan_layout.py", *flags])
    with pytest.raises(SystemExit) as exit_info:
        run_main(plan_layout.main)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


# ----------------------------------------------------------------------------- against measurement
# name: (xdist group, script, processes, run flags, the same layout for the planner). A run with a group is the one
# that group's parity test launches (shared_run: launched once, on that group's worker); the others run one step, in
# turn (ONE_STEP_RUNS). Pipelines run micro-batches of 32 so that activations, not the weights autograd also keeps,
# dominate what the run measures. The lora_ runs train LoRA adapters of rank 4 beside the frozen model: every weight
# counts in param_bytes, only the adapters in grad_bytes and optimizer_bytes, and the collectives change with them
# (FSDP reduce-scatters the adapters' gradients only; TP adds rank-4 all-reduces). The muon_ runs train with
# --optimizer muon: one momentum for the 12 hidden matrices in optimizer_bytes, AdamW's state for the rest; its
# gathers and scatters run in the optimizer step, after the counted forward and backward, so the counted collectives
# are AdamW's, and the plan's Muon figures are held to the run's `optimizer:` start line instead. The cp runs (ring
# attention, 4-digit addition: 16 tokens, 8 a rank) count the ring's sends and receives among their collectives; the
# plan counts the ring apart (ring_bytes_per_layer, ring_sends_per_layer), held to them.
FSDP_RUN = tuple(test_fsdp.FLAGS)  # the parity tests' runs
TP_RUN = tuple(test_tp.FLAGS)
ONE_STEP = ("--max_steps", "1")
RUNS = {
    "fsdp2": (
        "fsdp",
        "train_fsdp.py",
        2,
        [*FSDP_RUN, "--batch_size", "8", "--gradient_accumulation_steps", "1"],
        ["--dp_shard", "2", "--batch_size", "8", "--seq_len", "13"],
    ),
    "fsdp4": (  # 2 micro-batches of 2: gradients stay sharded, a reduce-scatter per unit and micro-batch
        "fsdp",
        "train_fsdp.py",
        4,
        [*FSDP_RUN, "--batch_size", "2", "--gradient_accumulation_steps", "2"],
        ["--dp_shard", "4", "--batch_size", "4", "--n_microbatches", "2", "--seq_len", "13"],
    ),
    "tp2": ("tp", "train_tp.py", 2, list(TP_RUN), ["--tp_size", "2", "--batch_size", "16", "--seq_len", "16"]),
    "pp2": (
        None,
        "train_pp.py",
        2,
        [*ONE_STEP, "--pp_size", "2", "--batch_size", "128", "--n_microbatches", "4"],
        ["--pp_size", "2", "--batch_size", "128", "--n_microbatches", "4", "--seq_len", "13"],
    ),
    "hsdp2x2": (
        None,
        "train_fsdp.py",
        4,
        [*ONE_STEP, "--dp_replicate", "2", "--batch_size", "4"],
        ["--dp_replicate", "2", "--dp_shard", "2", "--batch_size", "4", "--seq_len", "13"],
    ),
    "3d2x2x2": (
        None,
        "train_hybrid.py",
        8,
        [*ONE_STEP, "--n_layer", "4", "--pp_size", "2", "--dp_shard", "2", "--tp_size", "2", "--batch_size", "128"],
        ["--n_layer", "4", "--pp_size", "2", "--dp_shard", "2", "--tp_size", "2", "--batch_size", "128"]
        + ["--n_microbatches", "4", "--seq_len", "13"],
    ),
    "lora_fsdp2": (
        None,
        "train_fsdp.py",
        2,
        [*ONE_STEP, "--batch_size", "8", "--lora_r", "4"],
        ["--dp_shard", "2", "--batch_size", "8", "--seq_len", "13", "--lora_r", "4"],
    ),
    "lora_tp2": (
        None,
        "train_tp.py",
        2,
        [*ONE_STEP, "--batch_size", "16", "--addition_digits", "4", "--lora_r", "4"],
        ["--tp_size", "2", "--batch_size", "16", "--seq_len", "16", "--lora_r", "4"],
    ),
    "muon_fsdp2": (
        None,
        "train_fsdp.py",
        2,
        [*ONE_STEP, "--batch_size", "8", "--optimizer", "muon"],
        ["--dp_shard", "2", "--batch_size", "8", "--seq_len", "13", "--optimizer", "muon"],
    ),
    "muon_fsdp2_tp2": (  # every matrix cut twice: dealt over one group flattened from dp_shard x tp (4 ranks)
        None,
        "train_hybrid.py",
        4,
        [*ONE_STEP, "--dp_shard", "2", "--tp_size", "2", "--batch_size", "8", "--optimizer", "muon"],
        ["--dp_shard", "2", "--tp_size", "2", "--batch_size", "8", "--seq_len", "13", "--optimizer", "muon"],
    ),
    "muon_cp2": (  # CP: FSDP shards over dp_shard x cp (dp_shard_cp), so Muon deals its matrices over the 2 ranks
        None,
        "train_cp.py",
        2,
        [*ONE_STEP, "--cp_size", "2", "--batch_size", "8", "--addition_digits", "4", "--optimizer", "muon"],
        ["--cp_size", "2", "--batch_size", "8", "--seq_len", "16", "--optimizer", "muon"],
    ),
    "muon_cp2_tp2": (  # every matrix cut by FSDP (over cp) and TP: dealt over dp_shard_cp_tp, the 4 ranks
        None,
        "train_hybrid.py",
        4,
        [*ONE_STEP, "--cp_size", "2", "--tp_size", "2", "--dp_shard", "1", "--batch_size", "8", "--addition_digits"]
        + ["4", "--optimizer", "muon"],
        ["--cp_size", "2", "--tp_size", "2", "--batch_size", "8", "--seq_len", "16", "--optimizer", "muon"],
    ),
    "muon_tp2": (
        None,
        "train_tp.py",
        2,
        [*ONE_STEP, "--batch_size", "16", "--addition_digits", "4", "--optimizer", "muon"],
        ["--tp_size", "2", "--batch_size", "16", "--seq_len", "16", "--optimizer", "muon"],
    ),
    "muon_lora_tp2": (  # Muon takes the adapters: TP cuts half of them (B of column-wise layers, A of row-wise)
        None,
        "train_tp.py",
        2,
        [*ONE_STEP, "--batch_size", "16", "--addition_digits", "4", "--lora_r", "4", "--optimizer", "muon"],
        ["--tp_size", "2", "--batch_size", "16", "--seq_len", "16", "--lora_r", "4", "--optimizer", "muon"],
    ),
}
# the runs of no group: one step each, launched in turn (one launch per process count), on one worker
ONE_STEP_RUNS = [(script, nproc, *flags) for group, script, nproc, flags, _ in RUNS.values() if group is None]
MUON_DDP_RUN = ("train_ddp.py", 2, *ONE_STEP, "--optimizer", "muon")
ONE_STEP_RUNS.append(MUON_DDP_RUN)
MUON_DDP_LINE = re.compile(
    r"no matrix is cut; (\d+) whole matrices dealt round-robin over the (\d+) replicas, this rank orthogonalising "
    r"(\d+) and broadcasting them: ([\d.]+) MiB received by this rank"
)
MUON_LINE = re.compile(
    r"optimizer: Muon for (\d+) matrices .*?; (\d+) cut matrices made whole each step \((\d+) dealt round-robin, "
    r"this rank orthogonalising (\d+); (\d+) cut twice, gathered on every rank\): ([\d.]+) MiB received by this rank"
)


@pytest.mark.parametrize(
    "name",
    [pytest.param(name, marks=[pytest.mark.xdist_group(run[0] or "one_step")]) for name, run in RUNS.items()],
)
def test_plan_matches_the_measured_run(name, monkeypatch, capsys, shared_run):
    """A real run of the layout; the plan for the same layout gives its state bytes (1%), its
    first-step collectives (calls exactly; bytes exactly but for the pipeline's first-step shape
    metadata, a few hundred bytes), under a pipeline each stage's activations (25%), and with Muon
    what its optimizer step makes whole (the start line's counts exactly, its MiB to its 2 decimals)."""
    group, script, nproc, run_flags, plan_flags = RUNS[name]
    if group:  # the parity tests' runs, one launch per process count
        shared_run.in_turn({"fsdp": test_fsdp, "tp": test_tp}[group].PARITY_RUNS)
    else:
        shared_run.in_turn(ONE_STEP_RUNS)
    out, said = shared_run(script, nproc, *run_flags), shared_run.said(script, nproc, *run_flags)
    measured = summary(out)
    degrees = {"--pp_size": "1", "--dp_replicate": "1", "--dp_shard": "1", "--tp_size": "1", "--n_microbatches": "1"}
    degrees.update({f: v for f, v in zip(plan_flags[::2], plan_flags[1::2], strict=True) if f in degrees})
    others = [x for f, v in zip(plan_flags[::2], plan_flags[1::2], strict=True) if f not in degrees for x in (f, v)]
    record = plan(
        monkeypatch,
        capsys,
        *("--model_size", "tiny", "--world_size", str(nproc)),
        *[x for item in degrees.items() for x in item],
        *others,
    )[0]
    assert record["layout"] == measured["layout"]

    for field, value in measured["state_bytes_per_rank_max"].items():
        assert record["state_bytes_per_rank_max"][field] == pytest.approx(value, rel=0.01), field
    if name.startswith("fsdp"):  # ZeRO-3: each rank holds 1/N of DDP's parameters, gradients and Adam state
        assert measured["ideal_state_bytes_per_rank"] == pytest.approx(
            measured["ddp_state_bytes_per_rank"]["total_bytes"] / nproc, rel=1e-6
        )
        assert 1.0 <= measured["state_vs_ideal"] <= 1.05, measured["state_bytes_per_rank_max"]

    planned, seen = record["collectives_first_step_rank0"], dict(measured["collectives_first_step_rank0"])
    if "ring_bytes_per_layer" in record:  # CP's ring: a send and a receive per K/V (or dK/dV) block, counted apart
        assert record["layout"]["pp"] == 1  # (a pipeline's would be sends and receives too)
        blocks = int(degrees["--n_microbatches"]) * plan_layout.GPTConfig.from_preset("tiny").n_layer
        ring = {"calls": record["ring_sends_per_layer"] * blocks}
        ring["mib"] = sum(record["ring_bytes_per_layer"].values()) * blocks / 2**20
        for kind in ("send", "recv"):
            got = seen.pop(kind)
            assert got["calls"] == ring["calls"] and abs(got["mib"] - ring["mib"]) <= 1e-4, (kind, got, ring)
    assert {k: v["calls"] for k, v in planned.items()} == {k: v["calls"] for k, v in seen.items()}
    for kind, figures in seen.items():
        metadata = 0.001 if kind in ("send", "recv") else 0.0
        assert planned[kind]["mib"] - 1e-4 <= figures["mib"] <= planned[kind]["mib"] + 1e-4 + metadata, kind

    if "muon" in record:  # the optimizer step's gathers and scatters: rank 0's start line
        muon, line = record["muon"], MUON_LINE.search(said)
        assert line, said[-3000:]
        figures = ("matrices", "cut", "dealt_round_robin", "orthogonalised_rank0", "cut_twice")
        assert [muon[f] for f in figures] == [int(x) for x in line.groups()[:5]]
        assert abs(muon["received_mib_rank0"] - float(line[6])) <= 0.005
        kinds = muon["collectives_per_step_rank0"]
        assert sum(k["mib"] for k in kinds.values()) == pytest.approx(muon["received_mib_rank0"], abs=2e-4)
        calls = {"gather": muon["dealt_round_robin"], "scatter": muon["dealt_round_robin"]}
        calls["all_gather"] = 2 * muon["cut_twice"]  # a matrix cut twice: an all-gather per mesh dimension
        assert {k: v["calls"] for k, v in kinds.items()} == {k: n for k, n in calls.items() if n}

    if "peak_activation_mib_per_rank" in measured:
        planned_mib = [r["pipeline_activation_bytes"] / 2**20 for r in record["per_pp_rank"]]
        for stage, (mine, theirs) in enumerate(zip(planned_mib, measured["peak_activation_mib_per_rank"], strict=True)):
            assert 0.75 <= mine / theirs <= 1.25, f"stage {stage}: planned {mine:.3f} MiB, measured {theirs:.3f} MiB"


# ----------------------------------------------------------------------------- the planner alone
def test_muon_gathers_only_what_is_cut(monkeypatch, capsys):
    """--optimizer muon on tiny's 12 hidden matrices (98,304 values): DDP keeps them whole (their momentum, 4
    bytes a value, where AdamW keeps 8) and deals them over its 2 replicas: rank 0 orthogonalises 6 and receives
    the other 6 by broadcast (0.1875 MiB); FSDP 2 x TP 2 cuts each twice: dealt over one group of the
    4 ranks, rank 0 owning 3 (a gather and a scatter each, 0.1172 MiB received by rank 0: 3/4 of the 3 it owns,
    1/4 of the 9 others; the run's start line is held to it in test_plan_matches_the_measured_run). Its time
    joins the step's, and so does Newton–Schulz's: after the backward, nothing hides them."""
    flags = ("--model_size", "tiny", "--pp_size", "1", "--batch_size", "8", "--n_microbatches", "1")
    ddp = ("--world_size", "2", "--dp_replicate", "2", "--dp_shard", "1", "--tp_size", "1")
    adamw, muon = (plan(monkeypatch, capsys, *flags, *ddp, "--optimizer", o)[0] for o in ("adamw", "muon"))
    saved = adamw["state_bytes_per_rank_max"]["optimizer_bytes"] - muon["state_bytes_per_rank_max"]["optimizer_bytes"]
    assert saved == 4 * 98304 + 4 * 12  # and no step count
    assert muon["muon"]["matrices"] == 12 and muon["muon"]["cut"] == 0
    assert muon["muon"]["dealt_whole"] == 12 and muon["muon"]["orthogonalised_rank0"] == 6
    assert muon["muon"]["collectives_per_step_rank0"] == {"broadcast": {"calls": 12, "mib": 0.1875}}
    assert muon["optimizer_s"] > 0 and muon["newton_schulz_s"] > 0
    exposed = muon["optimizer_s"] + muon["newton_schulz_s"]
    assert muon["step_time_s"] == pytest.approx(adamw["step_time_s"] + exposed, abs=3e-6)
    fsdp_tp = ("--world_size", "4", "--dp_replicate", "1", "--dp_shard", "2", "--tp_size", "2")
    adamw, muon = (plan(monkeypatch, capsys, *flags, *fsdp_tp, "--optimizer", o)[0] for o in ("adamw", "muon"))
    assert muon["muon"]["cut_twice"] == 0 and muon["muon"]["received_mib_rank0"] == 0.1172
    assert muon["muon"]["dealt_round_robin"] == 12 and muon["muon"]["orthogonalised_rank0"] == 3
    gathers = {"gather": {"calls": 12, "mib": 0.0352}, "scatter": {"calls": 12, "mib": 0.082}}
    assert muon["muon"]["collectives_per_step_rank0"] == gathers
    assert muon["collectives_first_step_rank0"] == adamw["collectives_first_step_rank0"]
    exposed = muon["optimizer_s"] + muon["newton_schulz_s"]
    assert muon["step_time_s"] == pytest.approx(adamw["step_time_s"] + exposed, abs=3e-6)
    assert muon["optimizer_s"] > 0 and "optimizer_collectives_per_step_rank0" in adamw


def counted_flops(shape: tuple, steps: int = 5) -> int:
    """What torch's FlopCounterMode counts for common/muon.py's newton_schulz on one update of `shape`."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from common.muon import newton_schulz

    with FlopCounterMode(display=False) as counter:
        newton_schulz(torch.randn(shape), steps)
    return counter.get_total_flops()


@pytest.mark.xdist_group("one_step")
def test_muon_under_ddp_plan_matches_the_run(monkeypatch, capsys, shared_run):
    """train_ddp.py with --optimizer muon on 2 processes deals the whole matrices over its replicas: the plan's
    count, rank 0's share and the MiB it receives by broadcast are the run's `optimizer:` start line."""
    shared_run.in_turn(ONE_STEP_RUNS)
    said = shared_run.said(*MUON_DDP_RUN)
    line = MUON_DDP_LINE.search(said)
    assert line, said[-3000:]
    flags = ("--model_size", "tiny", "--world_size", "2", "--pp_size", "1", "--dp_replicate", "2", "--dp_shard", "1")
    muon = plan(monkeypatch, capsys, *flags, "--tp_size", "1", "--n_microbatches", "1", "--optimizer", "muon")[0]
    muon = muon["muon"]
    assert [muon["dealt_whole"], 2, muon["orthogonalised_rank0"]] == [int(x) for x in line.groups()[:3]]
    assert abs(muon["received_mib_rank0"] - float(line[4])) <= 0.005


def test_newton_schulz_flops_join_the_step(monkeypatch, capsys):
    """The planner's Newton–Schulz FLOPs are those FlopCounterMode counts running newton_schulz (a wide, a tall and
    a small matrix, an expert stack; 5 and 3 iterations). DDP 2 deals tiny's 12 whole matrices over its replicas,
    FSDP 2 its cut ones over its ranks: rank 0 orthogonalises 6 of them either way, half the FLOPs (tiny's
    matrices alternate, so exactly half). Their time, at the fp32 peak (the iteration runs in fp32, under
    bf16 too: 67 / 989 of the bf16 peak), joins the step after the backward: Muon's step exceeds AdamW's by it."""
    for shape, steps in (((64, 256), 5), ((256, 64), 5), ((4, 64), 5), ((2, 64, 128), 5), ((64, 256), 3)):
        assert plan_layout.newton_schulz_flops(shape, steps) == counted_flops(shape, steps), shape
    every = 2 * (4 * counted_flops((64, 64)) + counted_flops((256, 64)) + counted_flops((64, 256)))
    flags = ("--model_size", "tiny", "--world_size", "2", "--pp_size", "1", "--tp_size", "1", "--batch_size", "8")
    flags += ("--n_microbatches", "1", "--peak_tflops", "0.001")  # 1 GFLOP/s: seconds of Newton–Schulz, not 1e-6
    ddp, fsdp = ("--dp_replicate", "2", "--dp_shard", "1"), ("--dp_replicate", "1", "--dp_shard", "2")
    for layout, flops in ((ddp, every // 2), (fsdp, every // 2)):
        adamw, muon = (plan(monkeypatch, capsys, *flags, *layout, "--optimizer", o)[0] for o in ("adamw", "muon"))
        assert muon["muon"]["newton_schulz_flops_rank0"] == flops, layout
        assert muon["newton_schulz_s"] == pytest.approx(flops / 1e9, abs=1e-6)
        assert muon["step_time_s"] >= adamw["step_time_s"] + muon["optimizer_s"] + flops / 1e9 - 1e-6
    three = plan(monkeypatch, capsys, *flags, *fsdp, "--optimizer", "muon", "--ns_steps", "3")[0]["muon"]
    assert three["orthogonalised_rank0"] == 6 and three["newton_schulz_flops_rank0"] == every // 2 * 3 // 5
    for precision, peak in (("no", "0.067"), ("bf16", "0.989")):  # 67 GFLOP/s in fp32 either way
        given = ("--optimizer", "muon", "--peak_tflops", peak, "--mixed_precision", precision)
        record = plan(monkeypatch, capsys, *flags[:-2], *ddp, *given)[0]
        assert record["newton_schulz_s"] == pytest.approx(every // 2 / 0.067e12, rel=1e-3), precision


# train_ep.py with --optimizer muon, 2 processes, one step each, run in turn in one launch: (run flags, plan flags)
EP_MUON_RUNS = {
    "ep2": (["--n_experts", "4", "--top_k", "2"], ["--n_experts", "4", "--top_k", "2", "--ep_size", "2"]),
    "ep1": (
        ["--n_experts", "4", "--top_k", "2", "--ep_size", "1"],
        ["--n_experts", "4", "--top_k", "2", "--ep_size", "1"],
    ),
    "mixtral_ep2": (["--model_config", "mixtral"], ["--model_config", "mixtral", "--ep_size", "2"]),
}


def test_ep_muon_plan_matches_the_measured_runs(monkeypatch, capsys, tmp_path, data_cache):
    """train_ep.py --optimizer muon on 2 processes (the tiny GPT with 4 experts, top-2, at ep 2 and ep 1, and
    Mixtral's small 🤗 config at ep 2): the plan's state bytes are the run's, to the byte, and its Muon figures those
    of the run's `optimizer:` start line. At ep 2 the 4 expert stacks are cut along their experts only: each rank
    orthogonalises its own 2 experts of each where they lie, and only the 10 matrices FSDP cuts (attention and
    router) are dealt round-robin over the 2 ranks; at ep 1 FSDP cuts the stacks' rows, and they are dealt over the
    same group, after the rest. Rank 0's Newton–Schulz FLOPs at ep 2: its 5 dealt matrices (q and v of each block,
    block 0's router: every other one in model order) and its 2 experts of each stack, as FlopCounterMode counts."""
    cases = [
        [str(SCRIPTS / "train_ep.py"), [*TINY, *ONE_STEP, "--batch_size", "8", "--optimizer", "muon", *run_flags]]
        for run_flags, _ in EP_MUON_RUNS.values()
    ]
    for case, name in zip(cases, EP_MUON_RUNS, strict=True):
        case[1] += ["--data_cache_dir", data_cache, "--output_dir", str(tmp_path / name)]
    results = run_in_turn(cases, 2, tmp_path / "in_turn")
    records = {}
    for (name, (_, plan_flags)), result in zip(EP_MUON_RUNS.items(), results, strict=True):
        assert result["returncode"] == 0, f"{name}: {result['stderr'][-3000:]}"
        measured = summary(tmp_path / name)
        flags = ("--model_size", "tiny", "--world_size", "2", "--batch_size", "8", "--seq_len", "13")
        records[name] = record = plan(monkeypatch, capsys, *flags, *plan_flags, "--optimizer", "muon")[0]
        assert record["state_bytes_per_rank_max"] == measured["state_bytes_per_rank_max"], name
        muon, line = record["muon"], MUON_LINE.search(result["stdout"])
        assert line, result["stdout"][-3000:]
        figures = ("matrices", "cut", "dealt_round_robin", "orthogonalised_rank0", "cut_twice")
        assert [muon[f] for f in figures] == [int(x) for x in line.groups()[:5]], name
        assert abs(muon["received_mib_rank0"] - float(line[6])) <= 0.005, name
    assert [records["ep2"]["muon"][f] for f in ("matrices", "cut", "orthogonalised_rank0")] == [14, 10, 5]
    assert {c["group"] for c in records["ep2"]["optimizer_collectives_per_step_rank0"]} == {"dp"}
    assert [records["ep1"]["muon"][f] for f in ("cut", "dealt_round_robin", "orthogonalised_rank0")] == [14, 14, 7]
    mine = 4 * counted_flops((64, 64)) + counted_flops((4, 64)) + 2 * counted_flops((2, 64, 128))
    assert records["ep2"]["muon"]["newton_schulz_flops_rank0"] == mine + 2 * counted_flops((2, 128, 64))
    assert records["ep2"]["newton_schulz_s"] > 0 and records["ep2"]["optimizer_s"] > 0


def test_every_valid_layout_is_listed_once(monkeypatch, capsys):
    """tiny (2 layers, 4 heads) on 8 ranks: every pp x dp_replicate x dp_shard x tp = 8 with
    pp <= 2 layers and tp dividing the 4 heads; ranked: fitting first, then by predicted tokens/s."""
    records = plan(monkeypatch, capsys, "--model_size", "tiny", "--world_size", "8", "--n_microbatches", "2")
    layouts = sorted(tuple(r["layout"][d] for d in ("pp", "dp_replicate", "dp_shard", "tp")) for r in records)
    expected = sorted(
        (pp, dr, ds, tp)
        for pp in (1, 2)
        for tp in (1, 2, 4)
        for dr in (1, 2, 4, 8)
        for ds in (1, 2, 4, 8)
        if pp * dr * ds * tp == 8
    )
    assert layouts == expected
    assert [r["rank"] for r in records] == list(range(1, len(records) + 1))
    speeds = [r["tokens_per_s"] for r in records]
    assert speeds == sorted(speeds, reverse=True)


def test_fits_or_not_by_how_much(monkeypatch, capsys):
    """The 1b model (1.2B parameters, 16 bytes each with AdamW: 19 GB) on 8 GPUs: plain replicas
    do not fit in 16 GiB; sharded over 8 they do. The headroom is the memory left (or missing)."""
    flags = ("--model_size", "1b", "--world_size", "8", "--gpu_memory_gib", "16", "--batch_size", "1")
    flags += ("--n_microbatches", "1", "--seq_len", "512", "--mixed_precision", "bf16")
    replicas = plan(monkeypatch, capsys, *flags, "--pp_size", "1", "--dp_replicate", "8", "--dp_shard", "1")
    sharded = plan(monkeypatch, capsys, *flags, "--pp_size", "1", "--dp_replicate", "1", "--dp_shard", "8")
    a, b = replicas[0], sharded[0]
    assert not a["fits"] and a["headroom_bytes"] < 0 and b["fits"] and b["headroom_bytes"] > 0
    assert a["state_bytes_per_rank_max"]["total_bytes"] == pytest.approx(
        8 * b["state_bytes_per_rank_max"]["total_bytes"], rel=0.01
    )
    assert (
        a["headroom_bytes"]
        == a["gpu_memory_bytes"] - a["memory_bytes_per_rank_max"]
        == 16 * 2**30 - a["memory_bytes_per_rank_max"]
    )


def test_given_degrees_come_first_and_links_follow_the_nodes(monkeypatch, capsys):
    """TP 8 stays inside an 8-GPU node; TP 16 crosses nodes, and the plan says so and slows it."""
    flags = ("--model_size", "1b", "--world_size", "32", "--mixed_precision", "bf16", "--batch_size", "8")
    inside = plan(
        monkeypatch, capsys, *flags, "--pp_size", "1", "--dp_replicate", "1", "--dp_shard", "4", "--tp_size", "8"
    )
    across = plan(
        monkeypatch, capsys, *flags, "--pp_size", "1", "--dp_replicate", "1", "--dp_shard", "2", "--tp_size", "16"
    )
    assert inside[0]["layout"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "tp": 8}
    assert inside[0]["links"] == {"tp": "intra_node", "dp_shard": "inter_node"}
    assert across[0]["links"]["tp"] == "inter_node"
    assert across[0]["tp_s"] > 5 * inside[0]["tp_s"]


def test_network_file_replaces_the_default_links(monkeypatch, capsys):
    """A preflight result's intra-node link is used; its null inter-node link keeps the default."""
    flags = ("--model_size", "1b", "--world_size", "16", "--pp_size", "1", "--dp_replicate", "1", "--dp_shard", "2")
    flags += ("--tp_size", "8", "--mixed_precision", "bf16")
    default = plan(monkeypatch, capsys, *flags)[0]
    measured = plan(monkeypatch, capsys, *flags, "--network", str(NETWORK))[0]
    # TP runs on the intra-node link only: half the bandwidth (180 vs 360 GB/s), twice the latency
    assert measured["tp_s"] == pytest.approx(2 * default["tp_s"], rel=0.01)
    assert measured["dp_s"] == pytest.approx(default["dp_s"], rel=1e-6)  # FSDP crosses nodes: default link


def test_no_overlap_adds_the_data_parallel_time_to_the_compute(monkeypatch, capsys):
    """DDP on 2 nodes over a 20 Mbit/s link: overlapped, the step is the longer of the two; --no_overlap (CPUs,
    gloo) adds them, as bench_slow_links.py measured (1.52 s planned, 1.64 s measured)."""
    flags = ("--model_size", "small", "--seq_len", "128", "--world_size", "2", "--gpus_per_node", "1", "--pp_size", "1")
    flags += ("--dp_replicate", "2", "--dp_shard", "1", "--tp_size", "1", "--batch_size", "8", "--n_microbatches", "1")
    flags += ("--inter_node_GBps", "0.0025", "--peak_tflops", "0.5")
    overlapped = plan(monkeypatch, capsys, *flags)[0]
    added = plan(monkeypatch, capsys, *flags, "--no_overlap")[0]
    assert overlapped["dp_s"] == pytest.approx(3501056 / 0.0025e9, rel=0.01)  # the gradients once over the link
    assert overlapped["step_time_s"] == pytest.approx(max(overlapped["compute_s"], overlapped["dp_s"]), rel=1e-6)
    assert added["step_time_s"] == pytest.approx(added["compute_s"] + added["dp_s"], rel=1e-6)


def test_json_is_the_last_line_and_1b_on_1024_gpus_takes_seconds(monkeypatch, capsys):
    start = time.perf_counter()
    records = plan(monkeypatch, capsys, "--model_size", "1b", "--world_size", "1024", "--mixed_precision", "bf16")
    assert time.perf_counter() - start < 10
    assert len(records) > 100 and all(r["layout"] for r in records)
    # the command line itself: a table, then the JSON list as the last line of stdout
    result = run_cmd(
        [sys.executable, str(SCRIPTS / "plan_layout.py"), "--model_size", "tiny", "--world_size", "2", "--json"]
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert any("pp x dpr x dps x tp" in line for line in lines)
    layouts = [tuple(r["layout"].values()) for r in json.loads(lines[-1])]  # pp, dp_replicate, dp_shard, tp
    assert sorted(layouts) == [(1, 1, 1, 2), (1, 1, 2, 1), (1, 2, 1, 1), (2, 1, 1, 1)]


@pytest.mark.parametrize(
    "flags, says",
    [
        (
            ["--world_size", "8", "--pp_size", "2", "--dp_replicate", "1", "--dp_shard", "2", "--tp_size", "1"],
            "the degrees' product must equal the world size",
        ),
        (["--world_size", "7", "--tp_size", "2"], "does not divide --world_size 7"),
        (["--world_size", "6", "--tp_size", "3", "--model_size", "tiny"], "--tp_size 3 does not divide"),
        (["--world_size", "8", "--batch_size", "6", "--n_microbatches", "4"], "--batch_size 6 cannot be split"),
        (["--world_size", "8", "--seq_len", "4096"], "--seq_len 4096 exceeds"),
        (["--world_size", "8", "--network", str(REPO / "tests" / "data" / "missing.json")], "--network"),
        (["--world_size", "8", "--network", str(REPO / "README.md")], "--network"),
        (["--world_size", "8", "--optimizer", "muon", "--ns_steps", "0"], "--ns_steps must be at least 1 (got 0)"),
        (["--world_size", "2", "--n_experts", "4", "--optimizer", "lion"], "--optimizer 'lion' is not supported"),
    ],
)
def test_bad_input_is_one_line_naming_the_flag(flags, says, monkeypatch, capsys):
    assert says in usage_error(monkeypatch, capsys, *flags)


def test_context_parallel_cuts_activations_and_adds_the_ring(monkeypatch, capsys):
    """--cp_size 2: each rank keeps the activations of half the tokens, and the plan counts the ring's
    K/V blocks per layer: (cp-1) in forward, (cp-1) K/V + cp dK/dV in backward (train_cp.py's formula), one send
    each. FSDP shards over dp_shard x cp (dp_shard_cp: 8 ranks, every other one, so across two nodes of 8): half
    the parameters per rank; TP's all-reduces carry half the tokens."""
    flags = ("--model_size", "1b", "--mixed_precision", "bf16", "--seq_len", "2048", "--batch_size", "8")
    layout = ("--pp_size", "1", "--dp_replicate", "1", "--dp_shard", "4", "--tp_size", "2")
    plain = plan(monkeypatch, capsys, *flags, "--world_size", "8", *layout)[0]
    cp = plan(monkeypatch, capsys, *flags, "--world_size", "16", "--cp_size", "2", *layout)[0]
    assert cp["layout"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "cp": 2, "tp": 2}
    act = [r["per_pp_rank"][0]["activation_bytes_per_microbatch"] for r in (plain, cp)]
    assert act[1] == act[0] // 2
    block = 2 * 1 * (2048 // 2) * (2048 // 2) * 2  # K and V of one micro-batch, seq/cp tokens, d/tp wide, bf16
    assert cp["ring_bytes_per_layer"] == {"forward": block, "backward": 3 * block}
    assert cp["ring_sends_per_layer"] == 4
    assert "ring_bytes_per_layer" not in plain
    states = [r["state_bytes_per_rank_max"]["param_bytes"] for r in (plain, cp)]
    assert states[1] == states[0] // 2
    assert plain["links"] == {"tp": "intra_node", "dp_shard": "intra_node"}
    assert cp["links"] == {"tp": "intra_node", "dp_shard_cp": "inter_node"}
    comm = [{(c["group"], c["kind"]): c["bytes"] for c in r["collectives_per_step_rank0"]} for r in (plain, cp)]
    assert comm[1][("dp_shard_cp", "all_gather")] == comm[0][("dp_shard", "all_gather")]  # whole units, gathered
    assert comm[1][("tp", "all_reduce")] == comm[0][("tp", "all_reduce")] // 2


def test_a_sliding_window_ends_the_ring_early(monkeypatch, capsys):
    """--sliding_window 256 at cp 4 on 2048 tokens: the ring's own rule (train_cp.py's cp_chunks and
    ring_steps: contiguous chunks of 512, each rank needs only its neighbour's K/V) leaves 2 of the 4 steps:
    1 K/V block forward, 1 K/V + 2 dK/dV backward, against 3 and 7 without the window; a window as long as
    the sequence changes nothing."""
    flags = ("--model_size", "1b", "--mixed_precision", "bf16", "--seq_len", "2048", "--batch_size", "8")
    layout = ("--world_size", "4", "--cp_size", "4", "--pp_size", "1", "--dp_replicate", "1", "--dp_shard", "1")
    full = plan(monkeypatch, capsys, *flags, *layout, "--tp_size", "1")[0]
    windowed = plan(monkeypatch, capsys, *flags, *layout, "--tp_size", "1", "--sliding_window", "256")[0]
    whole = plan(monkeypatch, capsys, *flags, *layout, "--tp_size", "1", "--sliding_window", "2048")[0]
    block = 2 * 1 * (2048 // 4) * 2048 * 2  # K and V of one micro-batch, seq/cp tokens, d wide, bf16
    assert (
        full["ring_bytes_per_layer"] == whole["ring_bytes_per_layer"] == {"forward": 3 * block, "backward": 7 * block}
    )
    assert windowed["ring_bytes_per_layer"] == {"forward": block, "backward": 3 * block}, windowed
    assert windowed["ring_steps"] == 2 and whole["ring_steps"] == 4 and windowed["ring_s"] < full["ring_s"]
    assert full["ring_sends_per_layer"] == 10 and windowed["ring_sends_per_layer"] == 4  # 3 x steps - 2 blocks


def test_ulysses_plans_its_all_to_alls(monkeypatch, capsys):
    """--cp_impl ulysses: the same activations as the ring, and per layer 4 all-to-all buffers in forward (q, k,
    v, the output) and 4 in backward, each micro-batch x seq/cp x d (train_cp.py's formula, which
    tests/test_cp_ulysses.py checks against a run's counted bytes); the all-to-alls wait for their data, so
    the step is slower than compute by their whole time; heads that cp does not divide: one line."""
    flags = ("--model_size", "1b", "--mixed_precision", "bf16", "--seq_len", "2048", "--batch_size", "8")
    layout = ("--world_size", "16", "--cp_size", "4", "--pp_size", "1", "--dp_replicate", "1", "--dp_shard", "4")
    ring = plan(monkeypatch, capsys, *flags, *layout, "--tp_size", "1")[0]
    ulysses = plan(monkeypatch, capsys, *flags, *layout, "--tp_size", "1", "--cp_impl", "ulysses")[0]
    assert ulysses["cp_impl"] == "ulysses" and "ring_bytes_per_layer" not in ulysses
    act = [r["per_pp_rank"][0]["activation_bytes_per_microbatch"] for r in (ring, ulysses)]
    assert act[0] == act[1]
    buffer = 1 * (2048 // 4) * 2048 * 2  # one micro-batch, seq/cp tokens, d wide, bf16
    assert ulysses["ulysses_all_to_all_bytes_per_layer"] == {"forward": 4 * buffer, "backward": 4 * buffer}
    assert ulysses["ulysses_all_to_all_calls_per_layer"] == 8
    assert ulysses["step_time_s"] >= ulysses["compute_s"] + ulysses["ulysses_s"] > ulysses["compute_s"]
    # the ring carries (cp-1) K/V blocks forward and (2cp-1) backward, each 2 x micro-batch x seq/cp x d:
    # 10 blocks (20 buffers) at cp 4, against Ulysses' 8 buffers, of which 3/4 leave the rank
    ring_total = sum(ring["ring_bytes_per_layer"].values())
    assert ring_total == 10 * 2 * buffer and sum(ulysses["ulysses_all_to_all_bytes_per_layer"].values()) == 8 * buffer
    says = usage_error(monkeypatch, capsys, *flags, *layout, "--tp_size", "1", "--cp_impl", "ulysses", "--n_head", "2")
    assert (
        "--cp_size 4 --cp_impl ulysses cuts the attention heads over 4 ranks, but the model has 2 query heads" in says
    )
    tp_layout = ("--world_size", "16", "--cp_size", "4", "--pp_size", "1", "--dp_replicate", "1", "--dp_shard", "2")
    tp = usage_error(monkeypatch, capsys, *flags, *tp_layout, "--tp_size", "2", "--cp_impl", "ulysses")
    assert "--cp_impl ulysses runs in train_cp.py, which has no TP or PP" in tp


# ----------------------------------------------------------------------------- a 🤗 config (--model_config)
def real_model(config_path):
    """The model the training scripts build from --model_config (fp32, untied, the byte vocabulary)."""
    from argparse import Namespace

    from common.hf import load_hf_model

    args = Namespace(model_config=str(config_path), model_name_or_path=None, block_size=None)
    return load_hf_model(args, 16, "text", tokenizer=None)[0]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    from zoo_configs import write_configs

    return write_configs(tmp_path_factory.mktemp("zoo"))


def test_hf_config_is_counted_and_cut_as_the_scripts_build_it(zoo, monkeypatch, capsys):
    """Llama's tiny config: every parameter of the real model, with its shape; TP 2 cuts q/k/v, gate/up
    (rows), o/down (columns), the embedding and head (vocabulary rows) in half and keeps the norms whole;
    at TP 8 the 4 KV heads are replicated (each rank keeps one: head_dim rows of k and v)."""
    model = real_model(zoo["llama"])
    shape = plan_layout.HFShape(str(zoo["llama"]), 256, None)
    assert shape.n_params == sum(p.numel() for p in model.parameters())
    assert {p["name"]: p["shape"] for p in shape.params} == {n: tuple(p.shape) for n, p in model.named_parameters()}

    def expected_param_bytes(tp: int) -> int:
        total = 0
        for name, p in model.named_parameters():
            numel = p.numel()
            if any(k in name for k in ("q_proj", "gate_proj", "up_proj", "o_proj", "down_proj", "embed", "lm_head")):
                numel //= tp
            elif "k_proj" in name or "v_proj" in name:
                numel = max(numel // tp, 8 * 64)  # one KV head: head_dim 8 rows of 64
            total += 4 * numel
        return total

    flags = ("--model_config", str(zoo["llama"]), "--seq_len", "16", "--pp_size", "1", "--dp_replicate", "1")
    for tp in (2, 8):
        record = plan(monkeypatch, capsys, *flags, "--dp_shard", "1", "--tp_size", str(tp), "--world_size", str(tp))[0]
        assert record["state_bytes_per_rank_max"]["param_bytes"] == expected_param_bytes(tp), tp
    # PP 2: the embedding on stage 0, the norm and head on stage 1, two decoder layers each (AdamW: 16 bytes a
    # parameter, and a 4-byte step count per tensor: 2 x 9 + 1 and 2 x 9 + 2 tensors)
    pipeline = ("--world_size", "2", "--pp_size", "2", "--dp_replicate", "1", "--dp_shard", "1", "--tp_size", "1")
    record = plan(monkeypatch, capsys, *flags[:4], *pipeline, "--n_microbatches", "2")[0]
    stages = [r["state_bytes"] for r in record["per_pp_rank"]]
    layer = sum(p.numel() for n, p in model.named_parameters() if ".layers.0." in n)
    first = 2 * layer + model.model.embed_tokens.weight.numel()
    last = 2 * layer + model.model.norm.weight.numel() + model.lm_head.weight.numel()
    adam = [16 * n + 4 * k for n, k in ((first, 19), (last, 20))]
    assert stages == adam


def test_hf_moe_config_plans_expert_parallel(zoo, monkeypatch, capsys):
    """Mixtral's tiny config: train_ep.py's layouts; the experts' batched weights (4 x [256, 64] and
    4 x [64, 128] per layer) counted from the real model, cut over all 4 ranks (E / ep experts over dp / ep)."""
    model = real_model(zoo["mixtral"])
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert experts == 4 * 4 * (256 * 64 + 64 * 128)
    records = plan(monkeypatch, capsys, "--model_config", str(zoo["mixtral"]), "--world_size", "4", "--seq_len", "16")
    assert [r["ep"] for r in records] == [1, 2, 4]
    for r in records:
        assert r["total_params"] == sum(p.numel() for p in model.parameters())
        assert r["expert_param_bytes_per_rank"] == 4 * experts // 4 and r["moe_layers"] == 4
        assert r["active_params_per_token"] == r["total_params"] - experts // 2  # top-2 of 4 experts
        assert r["expert_gathered_bytes_per_layer"] == 4 * experts // r["ep"] // 4


def test_a_7b_llama_config(tmp_path, monkeypatch, capsys):
    """Llama 2 7B's config with its own vocabulary (--vocab_size 0): 6,738,415,616 parameters, Meta's figure.
    FSDP over 64 GPUs with 8 micro-batches: 1/64 of the state per rank; by default the gradients stay
    sharded (one layer's unsharded at a time, a reduce-scatter per micro-batch), with --unsharded_accumulation
    the whole model's (4 bytes a parameter) stay gathered, for 1/8 of the reduce-scatters."""
    config = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32}
    config |= {"num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000}
    config |= {"max_position_embeddings": 4096}
    path = tmp_path / "llama7b.json"
    path.write_text(json.dumps(config))
    flags = ("--model_config", str(path), "--vocab_size", "0", "--world_size", "64", "--pp_size", "1")
    flags += ("--dp_replicate", "1", "--dp_shard", "64", "--tp_size", "1", "--mixed_precision", "bf16")
    flags += ("--batch_size", "8", "--n_microbatches", "8", "--seq_len", "4096")
    sharded = plan(monkeypatch, capsys, *flags)[0]
    unsharded = plan(monkeypatch, capsys, *flags, "--unsharded_accumulation")[0]
    n = 6_738_415_616
    assert sharded["ddp_state_bytes_per_rank"]["param_bytes"] == 4 * n
    assert sharded["state_bytes_per_rank_max"]["total_bytes"] == pytest.approx(16 * n / 64, rel=0.01)
    layer = 4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096  # q, k, v, o; gate, up, down; two norms
    root = 2 * 32000 * 4096 + 4096  # embedding, final norm, head: the biggest unit
    assert layer < root
    # two units' bf16 weights (one computing, one prefetched) and one unit's fp32 gradient, or every gradient
    assert sharded["per_pp_rank"][0]["fsdp_gathered_bytes"] == 2 * 2 * root + 4 * root
    assert unsharded["per_pp_rank"][0]["fsdp_gathered_bytes"] == 2 * 2 * root + 4 * n
    calls = [{c["kind"]: c["calls"] for c in r["collectives_per_step_rank0"]} for r in (sharded, unsharded)]
    assert calls[0]["reduce_scatter"] == 8 * 33 and calls[1]["reduce_scatter"] == 33  # 32 layers + the root
    assert sharded["memory_bytes_per_rank_max"] < unsharded["memory_bytes_per_rank_max"] - 4 * n * 0.9


def test_hf_fsdp_plan_matches_the_measured_run(zoo, monkeypatch, capsys, tmp_path, data_cache):
    """One step of train_fsdp.py on Llama's tiny config, 2 ranks, 2 micro-batches: the plan's state bytes
    (1%) and first-step collectives (calls and MiB) are the run's."""
    out = tmp_path / "run"
    flags = ("--model_config", str(zoo["llama"]), "--addition_digits", "4", "--max_steps", "1")
    launch_tiny(
        "train_fsdp.py", out, data_cache, *flags, "--batch_size", "4", "--gradient_accumulation_steps", "2", nproc=2
    )
    measured = summary(out)
    record = plan(
        monkeypatch,
        capsys,
        *("--model_config", str(zoo["llama"]), "--seq_len", "16", "--world_size", "2", "--pp_size", "1"),
        *("--dp_replicate", "1", "--dp_shard", "2", "--tp_size", "1", "--batch_size", "8", "--n_microbatches", "2"),
    )[0]
    for field, value in measured["state_bytes_per_rank_max"].items():
        assert record["state_bytes_per_rank_max"][field] == pytest.approx(value, rel=0.01), field
    planned, seen = record["collectives_first_step_rank0"], measured["collectives_first_step_rank0"]
    assert {k: v["calls"] for k, v in planned.items()} == {k: v["calls"] for k, v in seen.items()}
    for kind, figures in seen.items():
        assert figures["mib"] == pytest.approx(planned[kind]["mib"], abs=1e-4), kind


def test_the_planners_tp_cuts_are_the_lessons_plan():
    """plan_layout.py reads the GPT's TP cuts from common/tp_costs.py (it imports no lesson): they must be
    those of train_tp.py's tensor_parallel_plan, parameter by parameter, with and without SP and loss parallel."""
    import torch
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from common.model import GPT, GPTConfig
    from train_tp import tensor_parallel_plan

    cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16)
    with torch.device("meta"):
        model = GPT(cfg)
    planned = {p["name"]: p["tp_dim"] for p in plan_layout.model_parameters(cfg)[0]}
    for sp, lp in [(False, False), (True, True)]:
        lesson = tensor_parallel_plan(model, sequence_parallel=sp, loss_parallel=lp)
        for module_name, module in model.named_modules():
            style = lesson.get(module_name)
            for short, _ in module.named_parameters(recurse=False):
                want = None
                if isinstance(style, ColwiseParallel):
                    want = 1 if isinstance(module, torch.nn.Embedding) else 0
                elif isinstance(style, RowwiseParallel) and short == "weight":
                    want = 0 if isinstance(module, torch.nn.Embedding) else 1
                assert planned[f"{module_name}.{short}"] == want, f"{module_name}.{short}: sp={sp}, lp={lp}"


# ----------------------------------------------------------------------------- LoRA (--lora_r)
def peft_parameters(model, **flags) -> dict:
    """{name: (shape, trains)} of `model` as the scripts' apply_lora leaves it (PEFT's adapters injected in
    place, the base frozen), the base layers under their own names (PEFT's `x.base_layer.weight` -> `x.weight`)."""
    from argparse import Namespace
    from types import SimpleNamespace

    from common.lora import apply_lora

    args = Namespace(lora_alpha=16.0, lora_dropout=0.0, merge_lora=False, model_name_or_path=None, **flags)
    model, _ = apply_lora(model, SimpleNamespace(), args)
    return {n.replace(".base_layer.", "."): (tuple(p.shape), p.requires_grad) for n, p in model.named_parameters()}


@pytest.mark.parametrize("targets", [None, "up_proj,o_proj"])
def test_lora_parameters_are_the_scripts_adapters(targets, zoo):
    """The planner's parameters under LoRA are those apply_lora leaves, name by name: the built-in GPT's and a 🤗
    Llama's, every projection (the default) or the ones named; A (r, in) and B (out, r) train, the rest is frozen."""
    import torch

    from common.model import GPT, GPTConfig

    cfg = GPTConfig.from_preset("tiny")
    torch.manual_seed(0)
    gpt = peft_parameters(GPT(cfg), lora_r=4, lora_target_modules=targets)
    planned, n_params = plan_layout.model_parameters(cfg, 4, targets)
    assert {p["name"]: (p["shape"], p["trains"]) for p in planned} == gpt
    assert n_params == sum(math.prod(shape) for shape, _ in gpt.values())
    assert sum(trains for _, trains in gpt.values()) == 2 * 2 * (6 if targets is None else 2)  # A, B; 2 blocks
    llama = peft_parameters(real_model(zoo["llama"]), lora_r=4, lora_target_modules=targets)
    shape = plan_layout.HFShape(str(zoo["llama"]), 256, None, 4, targets)
    assert {p["name"]: (p["shape"], p["trains"]) for p in shape.params} == llama
    assert shape.n_params == sum(math.prod(s) for s, _ in llama.values())


def test_lora_tp_adds_rank_r_all_reduces(monkeypatch, capsys):
    """TP 2 with adapters on o_proj and up_proj only, as a train_tp.py run measured them (13 all-reduces, 0.5781
    MiB): forward, the 5 of the model plus o_proj's A output (row-wise: partial sums) in each block; backward,
    the 5 of the model less block 0's attention input gradient (nothing before it trains, so autograd computes
    none), plus up_proj's B input gradient (column-wise) in each block; the adapters' all-reduces r = 4 wide."""
    flags = ("--model_size", "tiny", "--world_size", "2", "--pp_size", "1", "--dp_replicate", "1", "--dp_shard", "1")
    flags += ("--tp_size", "2", "--batch_size", "16", "--seq_len", "16", "--n_microbatches", "1")
    full = plan(monkeypatch, capsys, *flags)[0]
    lora = plan(monkeypatch, capsys, *flags, "--lora_r", "4", "--lora_target_modules", "up_proj,o_proj")[0]
    model, adapter = 256 * 64 * 4, 256 * 4 * 4  # tokens x width (or r), fp32
    assert full["collectives_first_step_rank0"]["all_reduce"] == {"calls": 10, "mib": round(10 * model / 2**20, 4)}
    assert lora["collectives_first_step_rank0"]["all_reduce"] == {
        "calls": 13,
        "mib": round((9 * model + 4 * adapter) / 2**20, 4),
    }
    assert lora["state_bytes_per_rank_max"]["grad_bytes"] == 4 * 2 * (4 * 32 + 64 * 4 + 4 * 64 + 128 * 4)
    assert lora["state_bytes_per_rank_max"]["param_bytes"] > full["state_bytes_per_rank_max"]["param_bytes"]


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--lora_r", "0"], "--lora_r must be at least 1 (got 0)"),
        (["--lora_r", "4", "--lora_target_modules", "q_proj,qkv"], "--lora_target_modules q_proj,qkv: qkv names no"),
        (["--lora_target_modules", "q_proj"], "--lora_target_modules needs --lora_r"),
        (["--lora_r", "4", "--n_experts", "4"], "--lora_r: --n_experts plans train_ep.py's layouts"),
    ],
)
def test_lora_bad_input_is_one_line_naming_the_flag(flags, says, monkeypatch, capsys):
    assert says in usage_error(monkeypatch, capsys, "--model_size", "tiny", "--world_size", "2", *flags)


def test_lora_on_copied_kv_heads_is_refused(zoo, monkeypatch, capsys):
    """Llama's 4 KV heads at TP 8 are copied over the ranks, which an adapter does not follow (lora_tp_plan refuses
    it): that layout cannot run with adapters on k_proj / v_proj, and can without them; a 🤗 MoE is refused."""
    flags = ("--model_config", str(zoo["llama"]), "--seq_len", "16", "--world_size", "8", "--tp_size", "8")
    says = usage_error(monkeypatch, capsys, *flags, "--lora_r", "4")
    assert "--tp_size 8 copies the model's 4 KV heads" in says
    assert plan(monkeypatch, capsys, *flags, "--lora_r", "4", "--lora_target_modules", "q_proj,o_proj")
    moe = usage_error(monkeypatch, capsys, "--model_config", str(zoo["mixtral"]), "--world_size", "2", "--lora_r", "4")
    assert "is a mixture of experts" in moe
