"""What the benchmarks share: how they start a run (gloo on loopback, one thread per process,
output discarded), from the repository root."""

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENV = {
    **os.environ,
    "GLOO_SOCKET_IFNAME": "lo",
    "OMP_NUM_THREADS": "1",
    "TQDM_DISABLE": "1",
    "HF_DATASETS_OFFLINE": "1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_cmd(script: str, args: list[str], nproc: int | None = None) -> list[str]:
    """`accelerate launch` with accelerate_configs/cpu_multi.yaml; `nproc` overrides its process count."""
    num_processes = ["--num_processes", str(nproc)] if nproc is not None else []
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        "accelerate_configs/cpu_multi.yaml",
        *num_processes,
        "--main_process_port",
        str(free_port()),
        script,
        *args,
    ]


def run_quiet(cmd: list[str], **env: str) -> None:
    """Run `cmd` from the repository root with ENV (plus `env`), output discarded; raise if it fails."""
    subprocess.run(cmd, cwd=REPO, env={**ENV, **env}, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def one_process_mesh():
    """A one-process gloo group on loopback and its 1-D CPU mesh, for benchmarks that time
    DTensor or FSDP code in this process, on one thread. Call destroy_process_group() after."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    return init_device_mesh("cpu", (1,))
