"""train_tp.py: Megatron-style tensor parallelism (DTensor), against the single-process run; and its
refusals: data parallel beside TP (train_hybrid.py's), and a TP plan that does not fit the model or the
flags (the plan lives in the script's MODEL section, so these run an edited copy of the script)."""

import shutil
import sys

import pytest
from test_bad_input import assert_refused

from conftest import (
    CPU_MULTI,
    SCRIPTS,
    TINY,
    assert_layout,
    assert_matches_reference,
    free_port,
    job_env,
    launch_tiny,
    resume_and_evaluate,
    run_cmd,
    summary,
)

# one xdist worker runs these tests: its parity runs are also the straight runs of its resume tests (shared_run)
pytestmark = pytest.mark.xdist_group("tp")

# 4-digit addition: 16-token rows, which 2 and 4 ranks can split for sequence parallel;
# answers have 2 to 6 target tokens, so micro-batches hold unequal target counts.
FLAGS = [
    "--max_steps",
    "20",
    "--batch_size",
    "16",
    "--addition_digits",
    "4",
    "--eval_every",
    "10",
    "--eval_batch_size",
    "64",
]
STEPS = list(range(1, 21))


CASES = [
    (2, []),
    (2, ["--sequence_parallel"]),
    (2, ["--loss_parallel"]),
    (4, []),
    (4, ["--sequence_parallel", "--loss_parallel"]),
]
# one launch per process count runs the cases in turn (shared_run.in_turn)
PARITY_RUNS = [("train_tp.py", nproc, *FLAGS, *extra) for nproc, extra in CASES]


@pytest.mark.parametrize("nproc, extra", CASES)
def test_matches_single_process(nproc, extra, reference, shared_run):
    shared_run.in_turn(PARITY_RUNS)
    out = shared_run("train_tp.py", nproc, *FLAGS, *extra)
    assert_layout(out, tp=nproc, dp_shard=1, pp=1)
    ref = reference(*FLAGS)
    assert_matches_reference(ref, out, STEPS)  # evals: reduced over the data-parallel group only, each sample once
    s = summary(out)
    assert s["state_bytes_per_rank_max"]["param_bytes"] < 0.6 * s["unsharded_param_bytes"]  # the big matrices are split
    if extra == ["--loss_parallel"]:
        assert_communication_matches_megatron(s)


def assert_communication_matches_megatron(s: dict) -> None:
    """Measured collectives of one step vs Megatron's count: per layer 2 all-reduces forward and 2
    backward of b*s*d, plus the vocab-parallel embedding's (forward) and the head input's (backward)."""
    comm, n_layer, activation_mib = s["collectives_first_step_rank0"], 2, 16 * 16 * 64 * 4 / 2**20
    assert s["megatron_allreduces_per_step"] == 4 * n_layer
    assert set(comm) == {"all_reduce"}, comm  # loss parallel: the logits are never gathered
    assert comm["all_reduce"]["calls"] == 4 * n_layer + 2
    assert abs(comm["all_reduce"]["mib"] - (4 * n_layer + 2) * activation_mib) < 1e-3


def test_resume_is_exact_and_final_model_evaluates(tmp_path, data_cache, shared_run):
    flags = [*TINY, *FLAGS, "--data_cache_dir", data_cache, "--sequence_parallel"]
    shared_run.in_turn(PARITY_RUNS)
    straight = shared_run("train_tp.py", 2, *FLAGS, "--sequence_parallel")  # also a case of the test above
    resume_and_evaluate("train_tp.py", flags, tmp_path, straight)


def test_tp_size_below_the_processes_is_refused(tmp_path, data_cache):
    """train_tp.py is TP only: --tp_size 1 on 2 processes would leave 2 data-parallel groups (train_hybrid.py's)."""
    out = tmp_path / "run"
    result = launch_tiny("train_tp.py", out, data_cache, *FLAGS, "--tp_size", "1", nproc=2, check=False)
    assert_refused(
        result,
        "--tp_size 1 on 2 processes leaves 2 data-parallel groups, but train_tp.py is tensor parallel only",
        "train_hybrid.py --dp_shard 2 --tp_size 1 (no TP split at all: train_fsdp.py)",
    )
    assert not out.exists() or not any(out.iterdir()), "a refused run wrote output"


def edited_copy(tmp_path, old: str, new: str):
    """scripts/train_tp.py and scripts/common copied to tmp_path, with `old` replaced by `new` in the copy's
    MODEL section (the plan of the built-in GPT): what a user changing that section would run."""
    scripts = tmp_path / "scripts"
    shutil.copytree(SCRIPTS / "common", scripts / "common", ignore=shutil.ignore_patterns("__pycache__"))
    text = (SCRIPTS / "train_tp.py").read_text()
    start = text.index("# ======================================== MODEL:")
    end = text.index("# ======================================== TP:")
    section = text[start:end]
    assert section.count(old) == 1, old
    (scripts / "train_tp.py").write_text(text[:start] + section.replace(old, new) + text[end:])
    return scripts / "train_tp.py"


WHERE = "in the MODEL section of train_tp.py (docs/your-model.md)"


@pytest.mark.parametrize(
    "old, new, flags, needles",
    [
        (  # a key that matches no module: parallelize_module itself would only warn, and leave q_proj whole
            'f"{b}.attn.q_proj": ColwiseParallel(),',
            'f"{b}.attn.nope": ColwiseParallel(),',
            [],
            [
                "the TP plan names 'blocks.0.attn.nope' (and 1 more key), but the model (GPT) has no module by",
                "its top-level modules are tok_emb, pos_emb, drop, blocks, ln_f, lm_head",
                "blocks.0.attn holds q_proj, k_proj, v_proj, o_proj",
                WHERE,
            ],
        ),
        (  # a plan that ignores --sequence_parallel: the flag would change nothing
            "return tensor_parallel_plan(model, sequence_parallel, loss_parallel)",
            "return tensor_parallel_plan(model, False, loss_parallel)",
            ["--sequence_parallel"],
            [
                "--sequence_parallel: the TP plan has no SequenceParallel style",
                "only ColwiseParallel, PrepareModuleInput, RowwiseParallel",
                WHERE,
            ],
        ),
        (  # a plan that ignores --loss_parallel: the logits would be gathered anyway
            "return tensor_parallel_plan(model, sequence_parallel, loss_parallel)",
            "return tensor_parallel_plan(model, sequence_parallel, False)",
            ["--loss_parallel"],
            [
                "--loss_parallel: the TP plan has no output layer that keeps its logits sharded over the vocabulary",
                "its last column-wise layer, 'lm_head', outputs Replicate() as a local tensor",
                WHERE,
            ],
        ),
    ],
    ids=["unknown_key", "sequence_parallel_ignored", "loss_parallel_ignored"],
)
def test_a_plan_that_does_not_fit_is_refused(old, new, flags, needles, tmp_path, data_cache):
    """The contract errors of the TP plan, on a real 2-process run of an edited copy of the script:
    one line naming what was looked for, what the model (or plan) has, and where to change it."""
    script, out = edited_copy(tmp_path, old, new), tmp_path / "run"
    args = [*TINY, *FLAGS, *flags, "--data_cache_dir", data_cache, "--output_dir", str(out)]
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_MULTI)]
    cmd = [*launcher, "--num_processes", "2", "--main_process_port", str(free_port()), str(script), *args]
    assert_refused(run_cmd(cmd, env=job_env()), *needles)
    assert not out.exists() or not any(out.iterdir()), "a refused run wrote output"
