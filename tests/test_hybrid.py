"""train_hybrid.py: DP x TP x PP on one device mesh, FSDP beside TP (--tp_size 1), a 🤗 model, and
checkpoints that move between layouts."""

import pytest

from conftest import (
    SCRIPTS,
    TINY,
    assert_layout,
    assert_same_evals,
    assert_same_losses,
    launch,
    resume_matches,
    run_in_turn,
    summary,
    train_losses,
)

# 4 layers, 10 steps, global batch 16; 4-digit addition (16-token rows: sequence parallel can split them);
# one evaluation, at the end
FLAGS = ["--n_layer", "4", "--max_steps", "10", "--addition_digits", "4", "--eval_batch_size", "64"]
# the first 200 validation samples: a pipeline evaluates in training's micro-batches, slowly on 8 processes and 2 cores
FLAGS += ["--max_eval_samples", "200"]
STEPS = list(range(1, 11))
UNSHARDED = "--unsharded_accumulation"
DEGREES = {"pp": "--pp_size", "dp_replicate": "--dp_replicate", "dp_shard": "--dp_shard", "tp": "--tp_size"}


def run_layout(nproc: int, layout: dict, flags: list[str], out, data_cache: str):
    degrees = [x for k, v in layout.items() for x in (DEGREES[k], str(v))]
    result = launch(
        "train_hybrid.py",
        [*TINY, *flags, *degrees, "--data_cache_dir", data_cache, "--output_dir", str(out)],
        nproc=nproc,
    )
    assert "rank   pp  dp_replicate  dp_shard  tp" in result.stdout  # the layout table
    assert_layout(out, **layout)
    return result


LAYOUTS = [
    # FSDP2 x TP2, 2 micro-batches: a reduce-scatter after each (gradients stay sharded)
    (
        4,
        {"dp_shard": 2, "tp": 2},
        ["--batch_size", "4", "--gradient_accumulation_steps", "2", "--sequence_parallel"],
    ),
    # HSDP, 2 micro-batches, --unsharded_accumulation: whole gradients through the window, one reduce-scatter
    (4, {"dp_replicate": 2, "dp_shard": 2}, ["--batch_size", "2", "--gradient_accumulation_steps", "2", UNSHARDED]),
    (4, {"pp": 2, "tp": 2}, ["--batch_size", "16", "--dp_shard", "1", "--loss_parallel"]),  # PP2 x TP2
]


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory, data_cache) -> list[tuple]:
    """The three 4-process layouts in one launch, in turn: [(output directory, stdout), ...]."""
    folder = tmp_path_factory.mktemp("hybrid_layouts")
    cases, outs = [], []
    for i, (_, layout, extra) in enumerate(LAYOUTS):
        degrees = [x for k, v in layout.items() for x in (DEGREES[k], str(v))]
        outs.append(folder / f"layout{i}")
        args = [*TINY, *FLAGS, *extra, *degrees, "--data_cache_dir", data_cache, "--output_dir", str(outs[-1])]
        cases.append([str(SCRIPTS / "train_hybrid.py"), args])
    results = run_in_turn(cases, 4, folder)
    for result in results:
        assert result["returncode"] == 0, result["stderr"]
    return [(out, result["stdout"]) for out, result in zip(outs, results, strict=True)]


@pytest.mark.xdist_group("hybrid_layouts")
@pytest.mark.parametrize("index", range(len(LAYOUTS)))
def test_layouts_match_single_process(index, layout_runs, reference):
    (_, layout, extra), (out, stdout) = LAYOUTS[index], layout_runs[index]
    assert "rank   pp  dp_replicate  dp_shard  tp" in stdout  # the layout table
    assert_layout(out, **layout)
    if "--gradient_accumulation_steps" in extra:  # the start line says how the window keeps the gradients
        said = "unsharded gradients held through the 2" if UNSHARDED in extra else "gradients stay sharded through"
        assert said in stdout
    ref = reference(*FLAGS, "--batch_size", "16")
    assert_same_losses(train_losses(ref), train_losses(out), STEPS, tol=1e-5)
    assert_same_evals(ref, out, samples=200)


# PP2 x FSDP2 x TP2 on 8 processes, launched once (8 processes on 2 cores are the slowest launch here): its
# checkpoint of step 5 is also the one that continues on one process below
THREE_D = {"pp": 2, "dp_shard": 2, "tp": 2}


@pytest.fixture(scope="module")
def three_d_run(tmp_path_factory, data_cache):
    out = tmp_path_factory.mktemp("hybrid_3d") / "run"
    flags = [*FLAGS, "--batch_size", "8", "--schedule", "interleaved_1f1b", "--checkpoint_every", "5"]
    run_layout(8, THREE_D, flags, out, data_cache)
    return out


@pytest.mark.xdist_group("hybrid_3d")
def test_3d_layout_matches_single_process(three_d_run, reference):
    ref = reference(*FLAGS, "--batch_size", "16")
    assert_same_losses(train_losses(ref), train_losses(three_d_run), STEPS, tol=1e-5)
    assert_same_evals(ref, three_d_run, samples=200)


@pytest.mark.xdist_group("hybrid_3d")
def test_3d_checkpoint_continues_on_one_process(three_d_run, reference, tmp_path, data_cache):
    """The 8-process PP x FSDP x TP checkpoint of step 5 (pipeline stages, FSDP shards and TP shards under
    full names) continues under train_ddp.py on one process with the uninterrupted run's losses."""
    out = tmp_path / "one_process"
    checkpoint = three_d_run / "checkpoints" / "step_5"
    launch(
        "train_ddp.py", [*_flags(16, data_cache), "--output_dir", str(out), "--resume_from_checkpoint", str(checkpoint)]
    )
    ref = reference(*FLAGS, "--batch_size", "16")
    assert sorted(train_losses(out)) == list(range(6, 11))
    assert_same_losses(train_losses(ref), train_losses(out), list(range(6, 11)), tol=1e-5)
    assert (out / "model" / "model.safetensors").is_file()


def test_tp_size_1_trains_fsdp_over_all_ranks(reference, tmp_path, data_cache):
    """--tp_size 1 --dp_shard 2 on 2 processes (train_tp.py is TP only now): a TP group of one rank has
    nothing to split, so no plan is applied and the two ranks train FSDP; the run says so, matches the
    single-process run, and its first step holds FSDP's collectives, exactly, and no TP all-reduce."""
    out = tmp_path / "tp1"
    result = run_layout(2, {"dp_shard": 2, "tp": 1}, [*FLAGS, "--batch_size", "8"], out, data_cache)
    assert "  order: FSDP\n" in result.stdout  # no "tensor parallel" in the order
    ref = reference(*FLAGS, "--batch_size", "16")
    assert_same_losses(train_losses(ref), train_losses(out), STEPS, tol=1e-5)
    assert_same_evals(ref, out, samples=200)
    s = summary(out)
    comm, n_units = s["collectives_first_step_rank0"], 4  # --n_layer 4: 4 FSDP units, then the root
    assert set(comm) == {"all_gather", "reduce_scatter"}, comm  # no all-reduce: nothing was split for TP
    # forward gathers the root and every unit; backward every unit again (each was resharded after its
    # forward), not the root (kept gathered from its forward to its backward). The root is gathered in this
    # step at all because check_task_contract, which runs the model before the loop, reshards it after.
    assert comm["all_gather"]["calls"] == (1 + n_units) + n_units
    # one reduce-scatter per FSDP unit and root (no accumulation): every gradient once, at full size
    assert comm["reduce_scatter"]["calls"] == 1 + n_units
    assert comm["reduce_scatter"]["mib"] == pytest.approx(s["unsharded_param_bytes"] / 2**20, abs=1e-3)


def _flags(batch: int, data_cache: str, *extra: str) -> list[str]:
    return [*TINY, *FLAGS, "--batch_size", str(batch), "--data_cache_dir", data_cache, *extra]


@pytest.mark.parametrize(
    "name, first, then",
    [
        # (script, nproc, batch, extra flags) saved at step 5 -> resumed under another script/layout
        (
            "fsdp4_to_fsdp2xtp2",
            ("train_fsdp.py", 4, 4, []),
            ("train_hybrid.py", 4, 8, ["--dp_shard", "2", "--tp_size", "2"]),
        ),
        ("tp2_to_pp2", ("train_tp.py", 2, 16, []), ("train_pp.py", 2, 16, [])),
        ("ddp2_to_fsdp4", ("train_ddp.py", 2, 8, []), ("train_fsdp.py", 4, 4, [])),
    ],
)
def test_checkpoint_moves_between_layouts(name, first, then, reference, tmp_path, data_cache):
    """Stopped at step 5 under one layout, continued under another: the losses of the
    uninterrupted single-process run from step 6 on; the data position carries over when the
    data-parallel size changes (same global batch)."""
    (script_a, n_a, batch_a, extra_a), (script_b, n_b, batch_b, extra_b) = first, then
    resume_matches(
        script_a,
        _flags(batch_a, data_cache, *extra_a),
        n_a,
        tmp_path / name,
        reference(*FLAGS, "--batch_size", "16"),
        resume_script=script_b,
        resume_flags=_flags(batch_b, data_cache, *extra_b),
        resume_nproc=n_b,
        stop=5,
        tol=1e-5,
    )
