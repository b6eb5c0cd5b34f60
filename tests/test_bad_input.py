"""Bad input: one clear line naming the problem, exit != 0, nothing overwritten."""

import hashlib
import re
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import SCRIPTS, TINY, free_port, job_env, launch_cmd, launch_tiny, run_cmd, run_in_turn, run_refused


def tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def assert_refused(result, *needles: str) -> None:
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr[-3000:]
    # no traceback out of our code (a multi-process launch adds torchrun's own report of the exit code)
    assert not [
        line for line in result.stderr.splitlines() if line.strip().startswith("File") and "/scripts/" in line
    ], result.stderr[-3000:]
    for needle in needles:
        assert needle in errors[0], errors[0]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, data_cache):
    """A short run with checkpoints at steps 2 and 4 and a final model."""
    out = tmp_path_factory.mktemp("bad_input") / "run"
    launch_tiny("train_ddp.py", out, data_cache, "--max_steps", "4", "--checkpoint_every", "2", "--keep_last", "0")
    return out


REFUSED = [
    (["--dataset", "imagenet"], ["--dataset 'imagenet'", "addition or pystdlib"]),
    (["--train_file", "no/such/file.txt"], ["--train_file no/such/file.txt", "no such file"]),
    (["--validation_file", "tests/test_bad_input.py"], ["--validation_file needs --train_file"]),
    (["--batch_size", "0"], ["--batch_size must be at least 1"]),
    (["--max_eval_samples", "0"], ["--max_eval_samples must be at least 1 (got 0)"]),
    (["--block_size", "8"], ["--block_size 8 is shorter than one addition problem"]),
    (["--model_size", "huge"], ["--model_size 'huge'"]),
    (["--n_head", "5"], ["--n_embd 64 is not divisible by --n_head 5"]),
    (["--resume_from_checkpoint", "latest"], ["--resume_from_checkpoint latest: no checkpoint"]),
    (
        ["--global_batch_size", "10", "--batch_size", "4"],
        ["--global_batch_size 10 must be a multiple of --batch_size 4 x 1 data-parallel ranks = 4"],
    ),
    (
        ["--global_batch_size", "16", "--batch_size", "4", "--gradient_accumulation_steps", "2"],
        ["--global_batch_size 16", "sets the accumulation itself (no --gradient_accumulation_steps)"],
    ),
]


@pytest.fixture(scope="module")
def refused_runs(tmp_path_factory, data_cache):
    """train_ddp.py with each of REFUSED's flags, all in one interpreter: [(result, its output directory)]."""
    root = tmp_path_factory.mktemp("refused")
    outs = [root / str(i) for i in range(len(REFUSED))]
    common = [*TINY, "--max_steps", "2", "--data_cache_dir", data_cache]
    cases = [("train_ddp.py", [*common, *flags, "--output_dir", out]) for (flags, _), out in zip(REFUSED, outs)]
    return list(zip(run_refused(cases), outs))


@pytest.mark.xdist_group("refused")
@pytest.mark.parametrize("case", range(len(REFUSED)), ids=[flags[0].lstrip("-") for flags, _ in REFUSED])
def test_refused_before_any_work(case, refused_runs):
    result, out = refused_runs[case]
    assert_refused(result, *REFUSED[case][1])
    assert not out.exists() or not any(out.iterdir()), "a refused run wrote output"


def test_unreachable_hub_is_one_line_naming_the_fixes(tmp_path, data_cache):
    """No network and no HF_HUB_OFFLINE=1: refused at once (not after datasets' ~25 s of retries)."""
    env = job_env(HF_ENDPOINT=f"http://127.0.0.1:{free_port()}")  # nothing listens there
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        env.pop(var, None)
    out = tmp_path / "run"
    flags = [*TINY, "--dataset_name", "karpathy/tiny_shakespeare", "--data_cache_dir", data_cache]
    result = run_cmd(launch_cmd("train_ddp.py", [*flags, "--output_dir", str(out)]), env=env, timeout=120)
    fixes = ["HF_HUB_OFFLINE=1", "a local folder as --dataset_name", "--train_file"]
    assert_refused(
        result, "--dataset_name karpathy/tiny_shakespeare: no such local folder", "cannot be reached", *fixes
    )
    assert not out.exists() or not any(out.iterdir()), "a refused run wrote output"


@pytest.mark.parametrize("script", ["evaluate.py", "merge_checkpoints.py"])
def test_help_states_each_default_once(script):
    """No "(default: None)": a flag without a default says in its help what happens without it."""
    result = run_cmd([sys.executable, str(SCRIPTS / script), "--help"], env=job_env(COLUMNS="200"), timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    text = " ".join(result.stdout.split())
    assert "(default: None)" not in text, text
    if script == "evaluate.py":  # the data set comes from the model, not from --dataset's training default
        assert "(default: addition)" not in text and "evaluation batch per process (default: 250)" in text
        assert "(default: the data set the model was trained on, from --model_dir's data.json)" in text
    else:
        assert text.count("(default: uniform)") == 1


def test_bad_data_on_two_processes_fails_fast(tmp_path, data_cache):
    """Every rank meets the error, none is left waiting at a barrier for the others."""
    flags = ["--dataset_name", str(tmp_path / "nowhere")]
    result = launch_tiny("train_ddp.py", tmp_path / "run", data_cache, *flags, nproc=2, check=False, timeout=120)
    assert_refused(result, "could not load --dataset_name")


def test_block_size_longer_than_the_data(tmp_path, data_cache):
    text = tmp_path / "small.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 3)  # 81 bytes
    flags = ["--train_file", str(text), "--validation_file", str(text), "--block_size", "128"]
    result = launch_tiny("train_ddp.py", tmp_path / "run", data_cache, *flags, check=False)
    assert_refused(result, "--block_size 128 is longer than the train split allows (81 bytes")


def test_fewer_samples_than_one_global_batch(tmp_path, data_cache):
    text = tmp_path / "small.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 30)
    flags = ["--train_file", str(text), "--validation_file", str(text), "--block_size", "16"]
    result = launch_tiny("train_ddp.py", tmp_path / "run", data_cache, *flags, check=False)
    assert_refused(result, "fewer than one global batch (64)", "--batch_size")


def test_block_size_longer_than_the_validation_data(tmp_path, data_cache):
    train, val = tmp_path / "train.txt", tmp_path / "val.txt"
    train.write_text("x = 1\n" * 2000)
    val.write_text("y = 2\n")
    flags = ["--train_file", str(train), "--validation_file", str(val), "--block_size", "32"]
    result = launch_tiny("train_ddp.py", tmp_path / "run", data_cache, *flags, check=False)
    assert_refused(result, "--block_size 32 is longer than the validation split allows")


# Runs refused on an existing run: train_ddp.py with these flags on the finished run (or on a damaged copy
# of it), all in one interpreter; each must leave its run as it was.
ON_THE_RUN = {
    "overwrite": ["--max_steps", "2"],
    "model_size": ["--n_layer", "3", "--max_steps", "6", "--resume_from_checkpoint", "latest"],
    "global_batch": ["--batch_size", "32", "--max_steps", "6", "--resume_from_checkpoint", "latest"],
}
DAMAGES = ["no_metadata", "bad_state_json", "truncated_shard", "not_a_checkpoint"]
# A damaged file found by the integrity check (trainer_state.json records every file's size and sha256):
# damage -> (the file, what the line says of it)
DAMAGED_FILES = {
    "scheduler_overwritten": ("scheduler.pt", "is damaged (its sha256 differs"),  # the same size: the digest
    "rng_missing": ("rng/rank_0.pt", "is missing"),
    "model_shard_truncated": ("state/__0_0.distcp", "is damaged (100 bytes, "),
}


def damaged_copy(finished_run: Path, damage: str, run: Path) -> Path:
    """A copy of the finished run at `run`, damaged; returns the path to resume from."""
    shutil.copytree(finished_run, run)
    ckpt = run / "checkpoints" / "step_4"
    if damage == "no_metadata":
        (ckpt / "state" / ".metadata").unlink()
    elif damage == "bad_state_json":
        (ckpt / "trainer_state.json").write_text('{"step": 4, "mod')
    elif damage == "truncated_shard":
        shard = next((ckpt / "state").glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:100])
    elif damage == "not_a_checkpoint":
        ckpt = run / "model"
    else:
        damage_file(ckpt / DAMAGED_FILES[damage][0], DAMAGED_FILES[damage][1])
    return ckpt


def damage_file(file: Path, how: str) -> None:
    """Damage `file` the way the integrity check's line names: removed, truncated, or overwritten in place."""
    if how == "is missing":
        file.unlink()
    elif how.startswith("is damaged (100 bytes"):
        file.write_bytes(file.read_bytes()[:100])
    else:
        file.write_bytes(bytes(b ^ 0xFF for b in file.read_bytes()))


@pytest.fixture(scope="module")
def refused_on_runs(finished_run, tmp_path_factory, data_cache):
    """name -> (result, the run it was pointed at, the run's digest before)."""
    runs = {name: (finished_run, flags) for name, flags in ON_THE_RUN.items()}
    root = tmp_path_factory.mktemp("damaged")
    for damage in [*DAMAGES, *DAMAGED_FILES]:
        ckpt = damaged_copy(finished_run, damage, root / damage)
        runs[damage] = (root / damage, ["--max_steps", "6", "--resume_from_checkpoint", str(ckpt)])
    before = {name: tree_digest(run) for name, (run, _) in runs.items()}
    common = [*TINY, "--data_cache_dir", data_cache]
    cases = [("train_ddp.py", [*common, *flags, "--output_dir", run]) for run, flags in runs.values()]
    results = run_refused(cases)
    return {name: (result, run, before[name]) for (name, (run, _)), result in zip(runs.items(), results, strict=True)}


def assert_refused_untouched(refused_on_runs: dict, name: str, *needles: str) -> None:
    """The run `name` was refused and left its run as it was."""
    result, run, before = refused_on_runs[name]
    assert_refused(result, *needles)
    assert tree_digest(run) == before


@pytest.mark.xdist_group("refused")
def test_new_run_does_not_overwrite_an_old_one(refused_on_runs):
    assert_refused_untouched(refused_on_runs, "overwrite", "already holds a run", "--overwrite_output_dir")


@pytest.mark.xdist_group("refused")
def test_resume_with_another_model_size_is_refused(refused_on_runs):
    assert_refused_untouched(
        refused_on_runs,
        "model_size",
        "saved by another model",
        "blocks.2.ln_1.weight: absent in the checkpoint, [64] in this model",
    )


@pytest.mark.xdist_group("refused")
def test_resume_with_another_global_batch_is_refused(refused_on_runs):
    assert_refused_untouched(refused_on_runs, "global_batch", "global batch 64, this run has 32")


@pytest.mark.xdist_group("refused")
@pytest.mark.parametrize("damage", DAMAGES)
def test_partial_or_unreadable_checkpoint_is_refused(refused_on_runs, damage):
    run = refused_on_runs[damage][1]
    ckpt = run / "model" if damage == "not_a_checkpoint" else run / "checkpoints" / "step_4"
    assert_refused_untouched(refused_on_runs, damage, f"--resume_from_checkpoint {ckpt}")


@pytest.mark.xdist_group("refused")
@pytest.mark.parametrize("damage", list(DAMAGED_FILES))
def test_every_file_of_a_checkpoint_is_checked(refused_on_runs, damage):
    """Any file the checkpoint wrote, damaged or gone: one line naming it, and the earlier checkpoint to resume."""
    checkpoints = refused_on_runs[damage][1] / "checkpoints"
    name, what = DAMAGED_FILES[damage]
    needles = [f"--resume_from_checkpoint {checkpoints / 'step_4'}: {name} {what}", "cannot be resumed"]
    assert_refused_untouched(
        refused_on_runs, damage, *needles, f"--resume_from_checkpoint {checkpoints / 'step_2'}", "start over"
    )


# DiLoCo on 2 processes: every rank saves its own replica (no_dist DCP) and the outer state (extra_state.pt)
DILOCO = ["--outer_optimizer", "nesterov", "--sync_every", "2", "--checkpoint_every", "2", "--keep_last", "0"]
SINGLE_PROCESS_WARNING = "assuming the intent is to"  # DCP's "... is disabled ... assuming ... a single process"


@pytest.fixture(scope="module")
def diloco_run(tmp_path_factory, data_cache):
    """A 2-process DiLoCo run with checkpoints at steps 2 and 4 and a final model: (its directory, its launch)."""
    out = tmp_path_factory.mktemp("diloco") / "run"
    return out, launch_tiny("train_localsgd.py", out, data_cache, *DILOCO, "--max_steps", "4", nproc=2)


@pytest.mark.xdist_group("diloco")
def test_each_rank_saving_its_replica_gives_no_single_process_warning(diloco_run, tmp_path, data_cache):
    """Each rank writes (and reads back) its own replica without collectives, on purpose: DCP's warning that it
    assumes a single process would contradict the 2-process run, on save and on resume."""
    run, saved = diloco_run
    assert (run / "checkpoints" / "step_4" / "state" / "rank_1").is_dir()
    assert SINGLE_PROCESS_WARNING not in saved.stderr, saved.stderr[-3000:]
    shutil.copytree(run, tmp_path / "run")
    flags = [*DILOCO, "--max_steps", "6", "--resume_from_checkpoint", "latest"]
    resumed = launch_tiny("train_localsgd.py", tmp_path / "run", data_cache, *flags, nproc=2)
    assert (tmp_path / "run" / "checkpoints" / "step_6").is_dir()  # it resumed, and saved again
    assert SINGLE_PROCESS_WARNING not in resumed.stderr, resumed.stderr[-3000:]


@pytest.mark.xdist_group("diloco")
def test_a_damaged_outer_state_is_one_line_on_every_rank(diloco_run, tmp_path, data_cache):
    """DiLoCo's extra_state.pt, truncated: one line naming it (not torch.load's traceback on every rank)."""
    run = tmp_path / "run"
    shutil.copytree(diloco_run[0], run)
    extra_state = run / "checkpoints" / "step_4" / "extra_state.pt"
    extra_state.write_bytes(extra_state.read_bytes()[:100])
    before = tree_digest(run)
    flags = [*DILOCO, "--max_steps", "6", "--resume_from_checkpoint", "latest"]
    result = launch_tiny("train_localsgd.py", run, data_cache, *flags, nproc=2, check=False, timeout=120)
    assert_refused(
        result,
        f"--resume_from_checkpoint {run / 'checkpoints' / 'step_4'}: extra_state.pt is damaged (100 bytes, ",
        f"resume from an earlier checkpoint (--resume_from_checkpoint {run / 'checkpoints' / 'step_2'})",
    )
    assert tree_digest(run) == before


SHARDED_REFUSED = [
    ("train_tp.py", 1, ["--tp_size", "2"], ["--tp_size 2", "does not divide the 1 processes"]),
    (
        "train_tp.py",
        1,
        ["--sequence_parallel"],
        ["--sequence_parallel shards over the TP group, but --tp_size is 1"],
    ),
    ("train_tp.py", 2, ["--n_head", "1"], ["--tp_size 2 does not divide --n_head (1)"]),
    (
        "train_tp.py",
        2,
        ["--sequence_parallel"],
        ["--sequence_parallel splits the 13-token sequence over --tp_size 2", "--addition_digits"],
    ),
    (
        "train_pp.py",
        1,
        ["--schedule", "gpipe", "--stages_per_rank", "2"],
        ["--stages_per_rank 2: --schedule gpipe runs one stage per rank"],
    ),
    ("train_pp.py", 1, ["--schedule", "dualpipe"], ["--schedule 'dualpipe' is not supported"]),
    (
        "train_pp.py",
        2,
        ["--n_layer", "1"],
        ["--pp_size 2 x --stages_per_rank 1 = 2 stages, but the model has 1 units"],
    ),
    (
        "train_pp.py",
        2,
        ["--batch_size", "6", "--n_microbatches", "4"],
        ["--batch_size 6 cannot be split into --n_microbatches 4"],
    ),
    (
        "train_pp.py",
        2,
        ["--schedule", "1f1b", "--n_microbatches", "1", "--batch_size", "4"],
        ["--n_microbatches 1 is fewer than the 2 pipeline ranks"],
    ),
    ("train_fsdp.py", 1, ["--cpu_offload"], ["--cpu_offload", "already on the CPU: drop it"]),
    ("train_hybrid.py", 1, ["--tp_size", "2", "--dp_shard", "1"], ["= 2, but 1 processes were started"]),
    (
        "train_hybrid.py",
        1,
        ["--tp_size", "-1", "--dp_shard", "-1"],
        ["only one of --dp_shard, --tp_size may be -1"],
    ),
    ("train_hybrid.py", 2, ["--tp_size", "2", "--n_head", "1"], ["--tp_size 2 does not divide --n_head (1)"]),
]
ONE_PROCESS = [c for c in SHARDED_REFUSED if c[1] == 1]


@pytest.fixture(scope="module")
def one_process_refusals(tmp_path_factory, data_cache):
    """The one-process cases of SHARDED_REFUSED, all in one interpreter: [(result, its output directory)]."""
    root = tmp_path_factory.mktemp("sharded_refused")
    outs = [root / str(i) for i in range(len(ONE_PROCESS))]
    common = [*TINY, "--max_steps", "2", "--data_cache_dir", data_cache]
    cases = [(script, [*common, *flags, "--output_dir", out]) for (script, _, flags, _), out in zip(ONE_PROCESS, outs)]
    return list(zip(run_refused(cases), outs))


@pytest.mark.xdist_group("refused")
@pytest.mark.parametrize("case", range(len(ONE_PROCESS)))
def test_sharded_scripts_refuse_before_any_work_on_one_process(case, one_process_refusals):
    result, out = one_process_refusals[case]
    assert_refused(result, *ONE_PROCESS[case][3])
    assert not out.exists() or not any(out.iterdir()), "a refused run wrote output"


MULTI_PROCESS = [c for c in SHARDED_REFUSED if c[1] > 1]


@pytest.fixture(scope="module")
def multi_process_refusals(tmp_path_factory, data_cache):
    """The multi-process cases of SHARDED_REFUSED, those of one process count in one launch, in turn
    (run_in_turn): [(result, its output directory)]."""
    root = tmp_path_factory.mktemp("sharded_refused_multi")
    outs = [root / str(i) for i in range(len(MULTI_PROCESS))]
    common = [*TINY, "--max_steps", "2", "--data_cache_dir", data_cache]
    found = {}
    for nproc in sorted({c[1] for c in MULTI_PROCESS}):
        mine = [i for i, c in enumerate(MULTI_PROCESS) if c[1] == nproc]
        cases = [
            [str(SCRIPTS / MULTI_PROCESS[i][0]), [*common, *MULTI_PROCESS[i][2], "--output_dir", str(outs[i])]]
            for i in mine
        ]
        for i, result in zip(mine, run_in_turn(cases, nproc, root / f"in_turn_{nproc}"), strict=True):
            found[i] = SimpleNamespace(**result)
    return [(found[i], outs[i]) for i in range(len(MULTI_PROCESS))]


@pytest.mark.xdist_group("refused_multi")
@pytest.mark.parametrize("case", range(len(MULTI_PROCESS)), ids=[f"{c[0]}-{c[1]}" for c in MULTI_PROCESS])
def test_sharded_scripts_refuse_before_any_work(case, multi_process_refusals):
    result, out = multi_process_refusals[case]
    assert_refused(result, *MULTI_PROCESS[case][3])
    assert not out.exists() or not any(out.iterdir()), "a refused run wrote output"


def test_sharded_script_refuses_an_accelerate_fsdp_launch(tmp_path, data_cache):
    """On CPU Accelerate would silently drop its FSDP plugin (docs/troubleshooting.md, "Accelerate's
    FSDP config is ignored on CPU"); FSDP2 is applied by the script."""
    out = tmp_path / "run"
    result = run_cmd(
        launch_cmd("train_fsdp.py", [*TINY, "--data_cache_dir", data_cache, "--output_dir", str(out)]),
        env=job_env(ACCELERATE_USE_FSDP="true"),
    )
    assert_refused(result, "also asked Accelerate for FSDP")
    assert not out.exists()


def test_a_model_without_the_unit_container_is_refused(tmp_path, data_cache):
    """A copy of train_fsdp.py whose MODEL section builds a model of its own but keeps the GPT's Task:
    one line naming what was looked for (`blocks`), what the model has, and where to change it."""
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    shutil.copytree(SCRIPTS / "common", scripts / "common", ignore=shutil.ignore_patterns("__pycache__"))
    text = (SCRIPTS / "train_fsdp.py").read_text()
    (old,) = re.findall(r"^    model, task = language_model\(args, data.*\n", text, re.M)  # the MODEL line
    own = "    model, task = torch.nn.Sequential(torch.nn.Linear(8, 8)), language_model(args, data)[1]\n"
    (scripts / "train_fsdp.py").write_text(text.replace(old, own))
    cmd = [sys.executable, str(scripts / "train_fsdp.py"), *TINY, "--data_cache_dir", data_cache]
    result = run_cmd([*cmd, "--output_dir", str(tmp_path / "run")])
    assert_refused(result, "the model (Sequential) has no 'blocks'", "its children are: 0", "MODEL section")
    assert not (tmp_path / "run").exists()  # refused before anything was written
