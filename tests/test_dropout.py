"""Dropout across ranks and resumes (docs/troubleshooting.md, "Dropout across ranks and resumes"): each
data-parallel rank draws its own masks, the ranks of one TP group the same ones, and a run stopped and
resumed with dropout 0.1 continues exactly (1e-6) as the straight run, in every script.

Every script's three runs (straight; stopped at step 3 with a checkpoint; resumed) go in one launch per
process count, through tests/dropout_probe.py, which records the generator state of each dropout call."""

import json

import pytest

from conftest import LAUNCH_TIMEOUT, SCRIPTS, TINY, assert_same_losses, launch_cmd, run_cmd, train_losses

pytestmark = pytest.mark.xdist_group("dropout")

DROPOUT = ["--dropout", "0.1", "--max_steps", "6", "--batch_size", "4"]
STOP = 3
RUNS = {  # name: (script, processes, its flags)
    "ddp_1": ("train_ddp.py", 1, []),
    "ddp_2": ("train_ddp.py", 2, []),
    "fsdp": ("train_fsdp.py", 2, []),
    "tp": ("train_tp.py", 2, ["--tp_size", "2", "--sequence_parallel", "--addition_digits", "4"]),  # DTensor dropout
    "pp": ("train_pp.py", 2, []),
    "localsgd": ("train_localsgd.py", 2, ["--sync_every", "2"]),
    "cp": ("train_cp.py", 2, ["--cp_size", "1"]),  # CP itself refuses --dropout: its data-parallel ranks
    "ep": ("train_ep.py", 2, ["--n_experts", "4", "--ep_size", "2"]),
    "hybrid": ("train_hybrid.py", 4, ["--dp_shard", "2", "--tp_size", "2"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache) -> dict:
    """name -> {"dir": its folder (straight/, resumed/), "results": the three runs' exits, "masks": {rank: the
    digests of the straight run's dropout calls}}."""
    found = {}
    for nproc in sorted({n for _, n, _ in RUNS.values()}):
        root = tmp_path_factory.mktemp(f"dropout_{nproc}")
        names = [name for name, (_, n, _) in RUNS.items() if n == nproc]
        cases = []
        for name in names:
            script, _, flags = RUNS[name]
            common = [*TINY, *DROPOUT, *flags, "--data_cache_dir", data_cache]
            straight, resumed = str(root / name / "straight"), str(root / name / "resumed")
            stop = ["--stop_at_step", str(STOP), "--checkpoint_every", str(STOP)]
            cases += [
                [str(SCRIPTS / script), [*common, "--output_dir", straight]],
                [str(SCRIPTS / script), [*common, "--output_dir", resumed, *stop]],
                [str(SCRIPTS / script), [*common, "--output_dir", resumed, "--resume_from_checkpoint", "latest"]],
            ]
        spec, results = root / "cases.json", root / "results.json"
        spec.write_text(json.dumps({"cases": cases, "results": str(results)}))
        probe = [str(root / "masks"), str(SCRIPTS.parent / "tests" / "zoo_driver.py"), str(spec)]
        done = run_cmd(launch_cmd("../tests/dropout_probe.py", probe, nproc=nproc), timeout=4 * LAUNCH_TIMEOUT)
        assert results.is_file(), f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
        exits = json.loads(results.read_text())
        masks = {r: json.loads((root / "masks" / f"rank_{r}.json").read_text()) for r in range(nproc)}
        for i, name in enumerate(names):
            straight = str(root / name / "straight")
            found[name] = {
                "dir": root / name,
                "results": exits[3 * i : 3 * i + 3],
                "masks": {r: masks[r].get(straight, []) for r in range(nproc)},
            }
    return found


@pytest.mark.parametrize("name", list(RUNS))
def test_resume_with_dropout_is_exact(runs, name):
    """Steps 4-6 after the resume at step 3 equal the straight run's (before: 1e-3 off, the loader built after
    the checkpoint's generator state was restored drew from it)."""
    run = runs[name]
    for result in run["results"]:
        assert result["returncode"] == 0, f"{name}: exit {result['returncode']}\n{result['stderr'][-3000:]}"
    straight, resumed = train_losses(run["dir"] / "straight"), train_losses(run["dir"] / "resumed")
    assert sorted(resumed) == list(range(1, 7))
    assert_same_losses(straight, resumed, range(STOP + 1, 7), tol=1e-6)
    assert any(n for n in run["masks"].values()), "no dropout call was recorded: the test would prove nothing"


@pytest.mark.parametrize(
    "name, same, own",
    [
        ("ddp_2", [], [(0, 1)]),
        ("fsdp", [], [(0, 1)]),
        ("localsgd", [], [(0, 1)]),
        ("cp", [], [(0, 1)]),
        ("ep", [], [(0, 1)]),
        ("pp", [], [(0, 1)]),  # two stages: other layers, so masks of their own (one process draws them in turn)
        ("tp", [(0, 1)], []),  # one TP group: its replicated activations must be dropped alike
        ("hybrid", [(0, 1), (2, 3)], [(0, 2), (1, 3)]),  # dp_shard 2 x tp 2: ranks 0, 1 are one TP group
    ],
)
def test_data_parallel_ranks_draw_their_own_masks(runs, name, same, own):
    """Every dropout call of the straight run draws from a generator state: the same list on the ranks of
    one TP group, no state in common between two data-parallel ranks (before: every rank drew the same)."""
    masks = runs[name]["masks"]
    assert all(masks.values()), f"{name}: a rank recorded no dropout call"
    for a, b in same:
        assert masks[a] == masks[b], f"{name}: ranks {a} and {b} (one TP group) drew different masks"
    for a, b in own:
        shared = set(masks[a]) & set(masks[b])
        assert not shared, f"{name}: data-parallel ranks {a} and {b} drew {len(shared)} masks from the same state"
