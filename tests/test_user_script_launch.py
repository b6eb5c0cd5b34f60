"""docs/troubleshooting.md, "Your own script runs as N lonely processes": a user's own script with a
plain `Accelerator()` (tests/user_script.py), launched on a CPU-only machine with
accelerate_configs/cpu_multi.yaml exactly as a user would.

cpu_multi.yaml is a MULTI_GPU config, so torchrun starts the processes, but only
ACCELERATE_USE_CPU=1 (or `Accelerator(cpu=True)`) makes them join one gloo group. Without it each
process is a run of its own and the launch still exits 0; `use_cpu: true` in the config does not
help, because accelerate passes ACCELERATE_USE_CPU on only from its single-process launcher. If
Accelerate ever changes that, the second test fails: then update that docs section."""

import sys
from pathlib import Path

import pytest
import torch

from conftest import CPU_MULTI, free_port, job_env, run_cmd

USER_SCRIPT = Path(__file__).with_name("user_script.py")


def launch_user_script(tmp_path: Path, config: Path, **env: str) -> list[str]:
    """2 processes of tests/user_script.py under `config`; the sorted lines the ranks wrote."""
    ranks = tmp_path / "ranks.txt"
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    cmd = [*launcher, "--num_processes", "2", "--main_process_port", str(free_port()), str(USER_SCRIPT), str(ranks)]
    job = job_env(**env)
    if "ACCELERATE_USE_CPU" not in env:
        job.pop("ACCELERATE_USE_CPU", None)
    result = run_cmd(cmd, timeout=120, env=job)
    assert result.returncode == 0, f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return sorted(ranks.read_text().splitlines())


def test_accelerate_use_cpu_joins_the_processes_in_one_group(tmp_path):
    """The documented fix: `ACCELERATE_USE_CPU=1 accelerate launch --config_file cpu_multi.yaml ...`."""
    lines = launch_user_script(tmp_path, CPU_MULTI, ACCELERATE_USE_CPU="1")
    assert lines == ["rank 0 of 2 DistributedType.MULTI_CPU", "rank 1 of 2 DistributedType.MULTI_CPU"], lines


@pytest.mark.skipif(torch.cuda.is_available(), reason="the trap is a machine without CUDA")
@pytest.mark.parametrize("use_cpu", ["false", "true"])
def test_without_it_each_process_is_alone(tmp_path, use_cpu):
    """The trap, silent (exit 0), with cpu_multi.yaml as shipped and with `use_cpu: true` in it."""
    config = tmp_path / "cpu_multi.yaml"
    text = CPU_MULTI.read_text()
    assert "\nuse_cpu: false\n" in text
    config.write_text(text.replace("\nuse_cpu: false\n", f"\nuse_cpu: {use_cpu}\n"))
    lines = launch_user_script(tmp_path, config)
    assert lines == ["rank 0 of 1 DistributedType.NO"] * 2, lines
