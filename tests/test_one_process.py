"""Every training script runs as one process, both ways a user starts one: `python scripts/X.py`
and `accelerate launch --config_file accelerate_configs/cpu_single.yaml scripts/X.py`; and it
then trains exactly what the single-process reference trains. A sharded script needs a process
group for its DeviceMesh, which neither way creates."""

import re
import sys

import pytest

from conftest import REPO, SCRIPTS, TINY, assert_same_losses, job_env, read_metrics, run_cmd, train_losses

SCRIPTS_UNDER_TEST = [
    "train_ddp.py",
    "train_fsdp.py",
    "train_tp.py",
    "train_pp.py",
    "train_hybrid.py",
    "train_localsgd.py",
]
FLAGS = ["--max_steps", "3", "--batch_size", "8"]
# one rank has nothing to cut: FSDP and TP are not applied (torchtitan's rule), and the run says so
SAYS = {
    "train_fsdp.py": "FSDP over 1 rank: nothing to shard, so fully_shard is not applied",
    "train_tp.py": "tensor parallel: 1 rank per group: nothing to split, so the TP plan is not applied",
    "train_hybrid.py": "order: none (one process)",
}


@pytest.mark.parametrize("how", ["python", "accelerate_single"])
@pytest.mark.parametrize("script", SCRIPTS_UNDER_TEST)
def test_one_process_runs_and_matches_the_reference(script, how, reference, tmp_path, data_cache):
    out = tmp_path / "run"
    args = [*TINY, *FLAGS, "--data_cache_dir", data_cache, "--output_dir", str(out)]
    if how == "python":
        cmd = [sys.executable, str(SCRIPTS / script), *args]
    else:
        config = REPO / "accelerate_configs" / "cpu_single.yaml"
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(config),
            str(SCRIPTS / script),
            *args,
        ]
    result = run_cmd(cmd, env=job_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    records = read_metrics(out)
    assert records[-1]["type"] == "summary" and records[-1]["world_size"] == 1
    assert (out / "model" / "model.safetensors").is_file()
    assert "model saved to" in result.stdout
    assert "  data addition: 100000 train / 1000 validation samples" in result.stdout  # the data set's name
    assert SAYS.get(script, "") in result.stdout
    eval_line = next(line for line in result.stdout.splitlines() if line.startswith("step 3: eval_loss"))
    four_digits = r"step 3: eval_loss \d\.\d{1,3}, num_samples 1000, exact_match [\d.e-]{1,9}"  # 4 significant digits
    assert re.fullmatch(four_digits, eval_line), eval_line
    assert_same_losses(train_losses(reference(*FLAGS)), train_losses(out), [1, 2, 3], tol=1e-5)


def test_output_dir_that_is_a_file_gets_one_line(tmp_path, data_cache):
    not_a_dir = tmp_path / "file.txt"
    not_a_dir.write_text("keep me")
    result = run_cmd(
        [
            sys.executable,
            str(SCRIPTS / "train_fsdp.py"),
            *TINY,
            "--max_steps",
            "1",
            "--data_cache_dir",
            data_cache,
            "--output_dir",
            str(not_a_dir),
        ],
        env=job_env(),
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: --output_dir {not_a_dir} is a file, not a folder: give a folder for the run's outputs"
    ]
    assert not_a_dir.read_text() == "keep me"


def test_resuming_a_finished_run_changes_nothing(tmp_path, data_cache):
    out = tmp_path / "done"
    args = [*TINY, "--max_steps", "2", "--batch_size", "8", "--checkpoint_every", "2", "--data_cache_dir", data_cache]
    assert (
        run_cmd(
            [sys.executable, str(SCRIPTS / "train_ddp.py"), *args, "--output_dir", str(out)], env=job_env()
        ).returncode
        == 0
    )
    before = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    result = run_cmd(
        [
            sys.executable,
            str(SCRIPTS / "train_ddp.py"),
            *args,
            "--output_dir",
            str(out),
            "--resume_from_checkpoint",
            "latest",
        ],
        env=job_env(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "already at --max_steps 2: nothing to do" in result.stdout
    assert {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == before


def test_resume_auto_starts_then_resumes(tmp_path, data_cache):
    """`--resume_from_checkpoint auto`: starts from step 0 when there is no complete checkpoint
    (replacing what an earlier attempt wrote before its first one), resumes when there is one,
    and says which; the result equals the uninterrupted run."""
    args = [*TINY, "--max_steps", "6", "--batch_size", "8", "--checkpoint_every", "3", "--data_cache_dir", data_cache]
    straight, out = tmp_path / "straight", tmp_path / "auto"
    assert (
        run_cmd([sys.executable, str(SCRIPTS / "train_fsdp.py"), *args, "--output_dir", str(straight)]).returncode == 0
    )
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"type": "train", "step": 1, "loss": 9.9}\n')  # an attempt killed before step 3
    auto = [
        sys.executable,
        str(SCRIPTS / "train_fsdp.py"),
        *args,
        "--output_dir",
        str(out),
        "--resume_from_checkpoint",
        "auto",
    ]
    first = run_cmd([*auto, "--stop_at_step", "3"])
    assert first.returncode == 0, first.stderr[-3000:]
    assert "--resume_from_checkpoint auto: no complete checkpoint, starting from step 0" in first.stdout
    second = run_cmd(auto)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"--resume_from_checkpoint auto: resuming from {out / 'checkpoints' / 'step_3'}" in second.stdout
    assert train_losses(out) == pytest.approx(train_losses(straight), abs=1e-6)
    assert sorted(train_losses(out)) == list(range(1, 7))
