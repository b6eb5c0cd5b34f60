"""The 🤗 model zoo through every script (issue 30): ten families from tiny configs (tests/zoo_configs.py,
random init, no download), each through train_ddp.py (1 and 2 processes), train_fsdp.py, train_tp.py,
train_pp.py, train_cp.py and, for the MoE families, train_ep.py on 2 processes, and train_hybrid.py on 4.

Every cell either matches the one-process train_ddp.py run within 1e-5 per step (fp32, global batch 16,
4-digit addition: answers of unequal target counts), or is refused before training with one `error:`
line (exit 2) naming the real limit. EXPECTED holds the refusals: a cell that starts being refused, or
stops being refused, fails the test, and a run that ends 0 with other losses always does.

Two launches run every cell in turn (tests/zoo_driver.py), one of 2 processes for the 2-process columns
and one of 4 for the hybrid's, beside the one-process reference's: start-up, not training, is what a
tiny run costs here. The table in docs/your-model.md is this test's output:

    ZOO_TABLE=zoo.md python -m pytest tests/test_hf_zoo.py -n 0 -s
"""

import os
import sys

import pytest
from zoo_configs import FAMILIES, MOE_FAMILIES, write_configs

from conftest import SCRIPTS, TINY, run_in_turn, train_losses

pytestmark = pytest.mark.xdist_group("hf_zoo")  # the launches share the reference: one worker runs them all

STEPS = range(1, 5)
FLAGS = ["--max_steps", "4", "--addition_digits", "4", "--eval_every", "0", "--collective_timeout", "120"]
PP = ["--n_microbatches", "4", "--schedule", "1f1b"]
# (column, script, processes, flags): each keeps the global batch of 16 samples
COLUMNS = [
    ("ddp 2", "train_ddp.py", 2, ["--batch_size", "8"]),
    ("fsdp 2", "train_fsdp.py", 2, ["--batch_size", "8"]),
    ("tp 2", "train_tp.py", 2, ["--batch_size", "16", "--sequence_parallel", "--loss_parallel"]),
    ("pp 2", "train_pp.py", 2, ["--batch_size", "16", *PP]),
    ("cp 2", "train_cp.py", 2, ["--batch_size", "16", "--cp_size", "2"]),
    ("ep 2", "train_ep.py", 2, ["--batch_size", "8"]),
    ("hybrid 4 (dp 2 x tp 2)", "train_hybrid.py", 4, ["--batch_size", "8", "--dp_shard", "2", "--tp_size", "2"]),
]
# (column, family) -> words the one `error:` line must hold: the real limit
EXPECTED = {}
for family in FAMILIES:
    if family not in MOE_FAMILIES:
        EXPECTED[("ep 2", family)] = "train this dense model with train_fsdp.py"
    elif family != "gpt_oss":  # the other MoE families' plans cut their experts' batched weights: train_ep.py's
        for column in ("tp 2", "hybrid 4 (dp 2 x tp 2)"):
            EXPECTED[(column, family)] = "experts' 3-D weights"


def cases_for(script: str, flags: list, families, configs, folder, data_cache) -> list:
    return [
        [
            str(SCRIPTS / script),
            [*TINY, *FLAGS, *flags, "--model_config", str(configs[family]), "--data_cache_dir", data_cache]
            + ["--output_dir", str(folder / family)],
        ]
        for family in families
    ]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory, data_cache):
    configs = write_configs(tmp_path_factory.mktemp("zoo_configs"))
    ref_dir = tmp_path_factory.mktemp("zoo_ref")
    ref = run_in_turn(
        cases_for("train_ddp.py", ["--batch_size", "16"], FAMILIES, configs, ref_dir, data_cache), 1, ref_dir
    )
    for family, result in zip(FAMILIES, ref, strict=True):
        assert result["returncode"] == 0, f"one-process train_ddp.py {family}:\n{result['stderr']}"
    return {"configs": configs, "ref": {family: train_losses(ref_dir / family) for family in FAMILIES}}


@pytest.fixture(scope="module")
def runs(zoo, data_cache, tmp_path_factory):
    """runs(column) -> (its output folder, each family's result): every column of one process count in one
    launch, the first time one of them is asked for."""
    done = {}

    def run(column: str):
        if column not in done:
            nproc = next(n for c, _, n, _ in COLUMNS if c == column)
            columns = [(c, s, f) for c, s, n, f in COLUMNS if n == nproc]
            folder = tmp_path_factory.mktemp(f"zoo_{nproc}")
            cases = []
            named = {c: folder / c.split(" (")[0].replace(" ", "") for c, _, _ in columns}  # "ddp 2" -> ddp2/
            for c, script, flags in columns:
                cases += cases_for(script, flags, FAMILIES, zoo["configs"], named[c], data_cache)
            results = run_in_turn(cases, nproc, folder)
            for i, (c, _, _) in enumerate(columns):
                done[c] = named[c], results[i * len(FAMILIES) : (i + 1) * len(FAMILIES)]
        return done[column]

    return run


TABLE: dict = {}


@pytest.mark.parametrize("column, script, nproc, flags", COLUMNS, ids=[c[0].split(" (")[0] for c in COLUMNS])
def test_every_family_matches_or_is_refused(column, script, nproc, flags, zoo, runs):
    folder, results = runs(column)
    wrong = []
    for family, result in zip(FAMILIES, results, strict=True):
        errors = [line for line in result["stderr"].splitlines() if line.startswith("error:")]
        expected = EXPECTED.get((column, family))
        if result["returncode"] == 0:
            ref, got = zoo["ref"][family], train_losses(folder / family)
            diff = max(abs(ref[s] - got[s]) for s in STEPS) if all(s in got for s in STEPS) else float("inf")
            TABLE[(column, family)] = f"{diff:.1e}"
            if diff > 1e-5:
                wrong.append(f"{family}: exit 0 with other losses (max |diff| {diff:.3g}): a silent wrong run")
            elif expected:
                wrong.append(f"{family}: trains and matches ({diff:.1e}), but EXPECTED says refused: update it")
        else:
            TABLE[(column, family)] = "refused"
            if result["returncode"] != 2 or len(errors) != 1:
                wrong.append(f"{family}: exit {result['returncode']}, not one error line:\n{result['stderr'][-1500:]}")
            elif not expected or expected not in errors[0]:
                wrong.append(f"{family}: refused ({errors[0]}), expected {expected or 'to match'}")
    write_table()
    assert not wrong, f"{script} on {nproc} processes:\n" + "\n".join(wrong)


def write_table() -> None:
    """The measured table (markdown) where ZOO_TABLE names a file: max |loss - one process| over 4 steps."""
    path = os.environ.get("ZOO_TABLE")
    if not path:
        return
    columns = [c[0] for c in COLUMNS]
    lines = ["| family | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for family in FAMILIES:
        cells = [TABLE.get((c, family), "") for c in columns]
        lines.append(f"| {family} | " + " | ".join(cells) + " |")
    refusals = sorted({f"- {c}, {f}: {EXPECTED[(c, f)]}" for c, f in EXPECTED if TABLE.get((c, f)) == "refused"})
    with open(path, "w") as out:
        out.write("\n".join(lines + ["", *refusals]) + "\n")
    print("\n".join(lines), file=sys.stderr)
