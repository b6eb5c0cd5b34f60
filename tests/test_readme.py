"""The README's commands: the test command is what CI runs, the main job runs end to end."""

import re
import shlex
import sys

from conftest import REPO, job_env, read_metrics, run_cmd

README = (REPO / "README.md").read_text()
COMMANDS = re.findall(r"```bash\n(.*?)\n```", README, flags=re.S)


def test_ci_runs_the_readme_test_command():
    ci_command = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci_command == COMMANDS[1], "the README's second command and .ci/run must be the same"
    assert "pytest" in ci_command and "requirements-dev.txt" in ci_command
    # the lint and format checks run first: a style error fails fast, before 10 minutes of tests
    assert ci_command.index("ruff check .") < ci_command.index("ruff format --check .") < ci_command.index("pytest")


def test_main_job_command_end_to_end(tmp_path, data_cache):
    main_job = COMMANDS[0].split(" && ")[-1]
    assert main_job.startswith("accelerate launch ") and "scripts/train_ddp.py" in main_job
    out = tmp_path / "ddp"
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *shlex.split(main_job)[2:],
        "--max_steps",
        "30",
        "--eval_every",
        "15",
        "--output_dir",
        str(out),
        "--data_cache_dir",
        data_cache,
    ]
    result = run_cmd(cmd, env=job_env())
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(out)
    train = [r for r in records if r["type"] == "train"]
    assert {r["world_size"] for r in train} == {2} and train[0]["global_batch_size"] == 128
    assert train[-1]["loss"] < train[0]["loss"]
    assert [r["step"] for r in records if r["type"] == "eval"] == [15, 30]
    assert records[-1]["type"] == "summary" and records[-1]["final_step"] == 30
    assert (out / "model" / "model.safetensors").is_file() and (out / "model" / "config.json").is_file()

    evaluate = next(line for line in README.splitlines() if line.startswith("python scripts/evaluate.py"))
    eval_args = [a.replace("runs/ddp/model", str(out / "model")) for a in shlex.split(evaluate)[1:]]
    result = run_cmd([sys.executable, *eval_args], env=job_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert '"num_samples": 1000' in result.stdout and " i.e. " in result.stdout


# ----------------------------------------------------------------------------- the core, by line
# issue 43: README's scripts table and its "read more" list point at the line where each lesson's strategy
# is applied (its first line of the strategy's own PyTorch calls); this is what that line holds.
CORE_LINES = {
    "train_ddp.py": "accelerator.prepare(model",
    "train_localsgd.py": "torch.distributed.all_reduce(flat)",
    "train_fsdp.py": "fully_shard(unit",
    "train_tp.py": "parallelize_module(model",
    "train_pp.py": "def split_pipeline",
    "train_ep.py": "received = all_to_all_single_autograd",
    "train_cp.py": "for step in range(steps):",
    "train_hybrid.py": "def apply_strategies",
}
# [... N ...](scripts/train_X.py#LN), or ../../scripts/ from docs/zh/
CORE_LINK = re.compile(r"\[[^\]]*?(\d+)[^\]\d]*\]\((?:\.\./\.\./)?scripts/(train_\w+\.py)#L(\d+)\)")


def test_the_readme_points_at_each_core_line():
    for page in (REPO / "README.md", REPO / "docs" / "zh" / "README.md"):
        text = page.read_text(encoding="utf-8")
        links = CORE_LINK.findall(text)
        assert {script for _, script, _ in links} == set(CORE_LINES), f"{page.name}: a lesson's core is not linked"
        for shown, script, number in links:
            assert shown == number, f"{page}: the link to scripts/{script}#L{number} says line {shown}"
            lines = (REPO / "scripts" / script).read_text().splitlines()
            line = lines[int(number) - 1] if int(number) <= len(lines) else ""
            assert CORE_LINES[script] in line, f"{page}: scripts/{script}#L{number} is `{line.strip()}`"
