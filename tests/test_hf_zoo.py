"""The 🤗 model zoo through every script (issue 30): eleven families from tiny configs (tests/zoo_configs.py,
random init, no download), each through train_ddp.py (1 and 2 processes), train_fsdp.py, train_tp.py,
train_pp.py, train_cp.py and, for the MoE families, train_ep.py on 2 processes, and train_hybrid.py on 4.

Every cell either matches the one-process train_ddp.py run within 1e-5 per step (fp32, global batch 16,
4-digit addition: answers of unequal target counts), or is refused before training with one `error:`
line (exit 2) naming the real limit. EXPECTED holds the refusals: a cell that starts being refused, or
stops being refused, fails the test, and a run that ends 0 with other losses always does.

Two launches run every cell in turn (tests/zoo_driver.py), one of 2 processes for the 2-process columns
and one of 4 for the hybrid's, beside the one-process reference's: start-up, not training, is what a
tiny run costs here. The table in docs/your-model-reference.md is this test's output:

    ZOO_TABLE=zoo.md python -m pytest tests/test_hf_zoo.py -n 0 -s

ZOO_MORE=1 trains instead, in the same three launches, the twenty-four families nobody here named (issue 42
and after; tests/more_zoo_configs.py: Qwen3-Next, Qwen3.5-MoE, BLOOM, Falcon, Gemma 2, Cohere 2, Starcoder 2,
Qwen2-MoE, GLM-4-MoE, LFM2, GPT-2, OPT, MPT, GPT-Neo, XGLM, Granite, RecurrentGemma, Mamba, Falcon-H1, Jamba,
MiniMax, Llama 4, JetMoE, PhiMoE) and holds them to MORE_EXPECTED: the page's second table, "Families nobody
here named". It is off by default, the suite being at its time budget (437 s against the first table's 260
s, on the same 2 cores):

    ZOO_MORE=1 ZOO_TABLE=more.md python -m pytest tests/test_hf_zoo.py -n 0 -s

Without a launch, test_the_page_shows_what_the_test_expects holds both tables of the page (EN and ZH) to
EXPECTED and MORE_EXPECTED: the same families and columns, "refused" exactly where a refusal is expected, every
other cell a figure within 1e-5, and the Chinese table's cells the English one's.
"""

import os
import re
import sys
from pathlib import Path

import pytest
from more_zoo_configs import MORE_FAMILIES, write_more_configs
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
EXPECTED: dict = {}
for family in FAMILIES:
    if family not in MOE_FAMILIES:
        EXPECTED[("ep 2", family)] = "train this dense model with train_fsdp.py"
    elif family != "gpt_oss":  # the other MoE families' plans cut their experts' batched weights: train_ep.py's
        for column in ("tp 2", "hybrid 4 (dp 2 x tp 2)"):
            EXPECTED[(column, family)] = "experts' 3-D weights"
# the same for MORE_FAMILIES (ZOO_MORE=1): the families nobody here named
MORE_EXPECTED: dict = {}
MORE_MOE = ("qwen3_next", "qwen3_5_moe_text", "qwen2_moe", "glm4_moe", "jamba", "minimax", "llama4_text", "phimoe")
NO_TP_PLAN = ("bloom", "falcon", "gpt2", "opt", "mpt", "gpt_neo", "xglm", "recurrent_gemma", "mamba", "jetmoe")
NO_PP_PLAN = (*NO_TP_PLAN, "lfm2", "falcon_h1", "jamba", "llama4_text", "phimoe")
UNNAMED_EXPERTS = ("llama4_text", "jetmoe")  # MoE, but their experts are named for no expert parallelism
for family in MORE_FAMILIES:
    if family in UNNAMED_EXPERTS:
        MORE_EXPECTED[("ep 2", family)] = "are not named for expert parallelism"
    elif family not in MORE_MOE:
        MORE_EXPECTED[("ep 2", family)] = "train this dense model with train_fsdp.py"
for family in (*MORE_MOE, *NO_TP_PLAN):  # the MoE plans cut 3-D experts; the others have no plan
    for column in ("tp 2", "hybrid 4 (dp 2 x tp 2)"):
        MORE_EXPECTED[(column, family)] = "has no TP plan" if family in NO_TP_PLAN else "experts' 3-D weights"
for family in NO_PP_PLAN:
    MORE_EXPECTED[("pp 2", family)] = "has no pipeline plan"
# Granite scales the embeddings and logits in its forward, outside the parts its pipeline plan names: PP's
# start-up check chains the stages against the whole model
MORE_EXPECTED[("pp 2", "granite")] = "chained, do not give the whole model's logits"
# CP: the cut check (scripts/common/cut_check.py) finds where the cut model parts from the whole one: a layer
# that mixes tokens outside the attention CP replaces (gated DeltaNet, BLOOM's ALiBi attention, LFM2's
# convolution, Mamba's scan, RG-LRU, MiniMax's linear attention), or an attention whose mask is not one of the
# keywords CP's attention takes (GPT-Neo's local window, XGLM, Llama 4's chunks); Falcon's and MPT's layers
# compute attention themselves, refused by the gate before the check
CUT_CHECK_PARTS = {
    "qwen3_next": "model.layers.0.linear_attn",
    "qwen3_5_moe_text": "model.layers.0.linear_attn",
    "bloom": "transformer.h.0.self_attention",
    "lfm2": "model.layers.0.conv",
    "gpt_neo": "transformer.h.0.attn.attention.out_proj",
    "xglm": "model.layers.0.self_attn.out_proj",
    "recurrent_gemma": "model.layers.0.temporal_block.rg_lru",
    "mamba": "backbone.layers.0.mixer.x_proj",
    "falcon_h1": "model.layers.0.mamba.out_proj",
    "jamba": "model.layers.0.mamba.x_proj",
    "minimax": "model.layers.0.self_attn.norm",
    "llama4_text": "model.layers.0.self_attn.o_proj",
}
for family, part in CUT_CHECK_PARTS.items():
    MORE_EXPECTED[("cp 2", family)] = f"first part at {part}"
for family in ("falcon", "mpt"):
    MORE_EXPECTED[("cp 2", family)] = "its layers compute attention themselves"

MORE = os.environ.get("ZOO_MORE") == "1"
ZOO = list(MORE_FAMILIES if MORE else FAMILIES)  # the families this run trains, in the table's order
REFUSED = MORE_EXPECTED if MORE else EXPECTED  # and the refusals it expects


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
    configs = (write_more_configs if MORE else write_configs)(tmp_path_factory.mktemp("zoo_configs"))
    ref_dir = tmp_path_factory.mktemp("zoo_ref")
    ref = run_in_turn(cases_for("train_ddp.py", ["--batch_size", "16"], ZOO, configs, ref_dir, data_cache), 1, ref_dir)
    for family, result in zip(ZOO, ref, strict=True):
        assert result["returncode"] == 0, f"one-process train_ddp.py {family}:\n{result['stderr']}"
    return {"configs": configs, "ref": {family: train_losses(ref_dir / family) for family in ZOO}}


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
                cases += cases_for(script, flags, ZOO, zoo["configs"], named[c], data_cache)
            results = run_in_turn(cases, nproc, folder)
            for i, (c, _, _) in enumerate(columns):
                done[c] = named[c], results[i * len(ZOO) : (i + 1) * len(ZOO)]
        return done[column]

    return run


TABLE: dict = {}  # (column, family) -> the cell: max |loss - one process| over the steps, or "refused"
REFUSALS: dict = {}  # (column, family) -> the refusal's line


@pytest.mark.parametrize("column, script, nproc, flags", COLUMNS, ids=[c[0].split(" (")[0] for c in COLUMNS])
def test_every_family_matches_or_is_refused(column, script, nproc, flags, zoo, runs):
    folder, results = runs(column)
    wrong = []
    for family, result in zip(ZOO, results, strict=True):
        errors = [line for line in result["stderr"].splitlines() if line.startswith("error:")]
        expected = REFUSED.get((column, family))
        if result["returncode"] == 0:
            ref, got = zoo["ref"][family], train_losses(folder / family)
            diff = max(abs(ref[s] - got[s]) for s in STEPS) if all(s in got for s in STEPS) else float("inf")
            TABLE[(column, family)] = f"{diff:.1e}"
            if not diff <= 1e-5:  # NaN too: a loss of NaN is no match
                wrong.append(f"{family}: exit 0 with other losses (max |diff| {diff:.3g}): a silent wrong run")
            elif expected:
                wrong.append(f"{family}: trains and matches ({diff:.1e}), but {expected!r} was expected: update it")
        else:
            TABLE[(column, family)] = "refused"
            REFUSALS[(column, family)] = errors[0] if errors else f"exit {result['returncode']}, no error line"
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
    for family in ZOO:
        cells = [TABLE.get((c, family), "") for c in columns]
        lines.append(f"| {family} | " + " | ".join(cells) + " |")
    refusals = [f"- {c}, {f}: {REFUSALS[(c, f)]}" for f in ZOO for c in columns if (c, f) in REFUSALS]
    with open(path, "w") as out:
        out.write("\n".join(lines + ["", *refusals]) + "\n")
    print("\n".join(lines), file=sys.stderr)


PAGES = {"docs/your-model-reference.md": "refused", "docs/zh/your-model-reference.md": "拒绝"}  # page -> "refused"


def page_tables(path: Path) -> list[dict]:
    """The markdown tables of the zoo's section of a page: [{(column, family): cell}, ...]."""
    text = path.read_text(encoding="utf-8")
    start = text.index('<a id="the--model-zoo-measured">' if "zh" in path.parts else "### The 🤗 model zoo, measured")
    section = text[start : text.index("\n## ", start)]
    tables, header = [], None
    for line in section.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if header is None:
            header = cells[1:]
            tables.append({})
        elif not re.fullmatch(r"-+", cells[0]):
            tables[-1].update({(column, cells[0]): cell for column, cell in zip(header, cells[1:], strict=True)})
    return tables


@pytest.mark.parametrize("page", PAGES)
def test_the_page_shows_what_the_test_expects(page):
    """Both tables of the page agree with this test: a cell that the runs would change (the section regenerated
    by hand from ZOO_TABLE's output) cannot be left standing, and the Chinese edition carries the same figures."""
    refused, english = PAGES[page], page_tables(Path(__file__).resolve().parents[1] / "docs/your-model-reference.md")
    tables = page_tables(Path(__file__).resolve().parents[1] / page)
    assert len(tables) == 2, f"{page}: {len(tables)} tables in the zoo's section, not 2 (the zoo, families more)"
    for table, families, expected, in_english in zip(
        tables, (FAMILIES, MORE_FAMILIES), (EXPECTED, MORE_EXPECTED), english, strict=True
    ):
        columns = [c for c, *_ in COLUMNS]
        assert sorted(table) == sorted((c, f) for f in families for c in columns), f"{page}: other rows or columns"
        for (column, family), cell in table.items():
            if (column, family) in expected:
                assert cell == refused, f"{page}: {family}, {column} shows {cell}, but the test expects it refused"
            else:
                assert cell != refused and float(cell) <= 1e-5, f"{page}: {family}, {column} shows {cell}"
            assert cell == in_english[(column, family)].replace("refused", refused), f"{page}: {family}, {column}"
