"""Launching a training run: the Accelerator with the CPU traps handled and the launch-trap checks,
the process groups a run makes and ends, and `run_main`, which turns bad input into one line."""

from __future__ import annotations

import gc
import os
import sys
from datetime import timedelta

import torch
from accelerate.utils import get_int_from_env

from .errors import NothingToDo, RunPosition, UsageError

# Where launchers put how many processes they started (torchrun WORLD_SIZE, mpirun PMI_SIZE ...):
# get_int_from_env(WORLD_SIZE_VARS, 1), Accelerate's own reading of them.
WORLD_SIZE_VARS = ["WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"]


def run_main(main) -> None:
    """Run `main()`; turn a UsageError into one line on stderr (from rank 0) and exit 2.

    The other ranks wait a little first (wait_for_rank0_to_report), so the line is not lost.

    Every way out ends the process groups first (end_process_groups): none may be left for the
    interpreter's shutdown to free (docs/fault-tolerance.md, "Clean exits").

    A collective that fails because a peer froze or died ends the run with one line naming the
    step and the collective (lost_peer_line), exit code 1."""
    try:
        main()
    except UsageError as e:
        from .faults import report_to_launcher, wait_for_rank0_to_report  # the ways a failing run reports

        if int(os.environ.get("RANK", "0")) != 0 and get_int_from_env(WORLD_SIZE_VARS, 1) > 1:
            wait_for_rank0_to_report()
        print(f"error: {e}", file=sys.stderr, flush=True)
        report_to_launcher(f"error: {e}")
        end_process_groups()
        sys.exit(2)
    except NothingToDo as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(str(e), flush=True)
        end_process_groups()
        sys.exit(0)
    except BaseException as e:  # CheckpointException (a peer lost during a save) is a BaseException
        from .faults import lost_peer_line, report_to_launcher

        line = lost_peer_line(e)
        if line is None:
            raise
        # every rank that saw it says so (the one that froze or died may be rank 0)
        print(line, file=sys.stderr, flush=True)
        report_to_launcher(line)
        sys.stdout.flush()
        os._exit(1)  # tearing the process group down could wait for the lost peer
    end_process_groups()


def end_process_groups() -> None:
    """Destroy the process group where the run has not (the one-process group of a sharded
    script, an early error), then free the groups the meshes still hold. Left to the
    interpreter's shutdown, gloo's C++ teardown aborted about one finished run in 25 on a loaded
    machine (release_process_groups)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    release_process_groups()
    # Nothing is garbage after release_process_groups' collection: move every object to the
    # permanent generation, so the interpreter's shutdown does not walk the ~3M objects that
    # torch's modules create once more (about 1 s per process).
    gc.freeze()


def check_launch() -> None:
    """docs/troubleshooting.md, "Only one process started": `accelerate launch --cpu --num_processes 2`,
    or a MULTI_CPU config
    without an mpirun hostfile, starts ONE process. The launcher leaves a trace: it sets
    MASTER_ADDR (only done when asked for more than one process or machine) and
    ACCELERATE_USE_CPU (only its single-process launcher does), but no WORLD_SIZE."""
    asked_for_more = "MASTER_ADDR" in os.environ and "ACCELERATE_USE_CPU" in os.environ
    if asked_for_more and get_int_from_env(WORLD_SIZE_VARS, 1) == 1:
        raise UsageError(
            "accelerate launch was asked for several processes but started only one (a --cpu or MULTI_CPU launch "
            "without an mpirun hostfile does that): use --config_file accelerate_configs/cpu_multi.yaml, "
            "or --multi_gpu --num_processes N"
        )


def launcher_sharding() -> str | None:
    """The sharded strategy an Accelerate config asked for (FSDP, DeepSpeed, Megatron-LM), if any.
    Read from the launcher's environment: on CPU Accelerate silently drops an FSDP config
    (docs/troubleshooting.md, "Accelerate's FSDP config is ignored on CPU"), so the Accelerator's state
    would not tell."""
    return next(
        (
            name
            for name in ("FSDP", "DEEPSPEED", "MEGATRON_LM")
            if os.environ.get(f"ACCELERATE_USE_{name}", "false").lower() == "true"
        ),
        None,
    )


def make_accelerator(args, cpu: bool | None = None, sharded: bool = False, **accelerator_kwargs):
    """The Accelerator, with the CPU traps handled:
    - "Several processes that each think they are alone" (docs/troubleshooting.md): a torchrun-style
      launch (`--multi_gpu`, MULTI_GPU config) on a machine without
      CUDA starts N processes that each think they are alone, unless told to use the CPU:
      the scripts pass cpu=True whenever CUDA is missing (the default here too), and they join one
      gloo process group; if they still do not, the run stops with one line;
    - the collective timeout: a dead peer fails the run after `--collective_timeout` s."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    check_launch()
    expected = get_int_from_env(WORLD_SIZE_VARS, 1)
    if "OMP_NUM_THREADS" not in os.environ:  # torchrun sets it to 1; a plain `python` run shares the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))))
    use_cpu = cpu if cpu is not None else (args.cpu or not torch.cuda.is_available())
    RunPosition.collective_timeout = args.collective_timeout
    init_restart_safe_group(use_cpu, timedelta(seconds=args.collective_timeout))
    accelerator = Accelerator(
        cpu=use_cpu,
        log_with=None if args.report_to == "none" else args.report_to,
        project_dir=args.output_dir,
        kwargs_handlers=[
            InitProcessGroupKwargs(timeout=timedelta(seconds=args.collective_timeout)),
            *accelerator_kwargs.pop("kwargs_handlers", []),
        ],
        **accelerator_kwargs,
    )
    if accelerator.num_processes != expected:  # never N silent single-process runs
        raise UsageError(
            f"the launcher started {expected} processes but they did not join one group (each sees "
            f"{accelerator.num_processes}): launch with accelerate launch --config_file "
            "accelerate_configs/cpu_multi.yaml"
        )
    if sharded:
        check_sharded_launch(accelerator)
        init_one_process_group(accelerator)
    return accelerator


def init_restart_safe_group(use_cpu: bool, timeout: timedelta) -> None:
    """Under torchrun the workers share the launcher's key-value store, and it outlives a restart
    (`--max_restarts`): the new workers would find the dead ones' addresses in it and fail to
    connect ("Gloo connectFullMesh failed ... Connection refused"). So the process group is made
    here, on a view of the store named after the attempt; Accelerate then uses it as it is."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or torch.distributed.is_initialized():
        return
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = torch.distributed.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    torch.distributed.init_process_group(
        "gloo" if use_cpu else "nccl",
        store=torch.distributed.PrefixStore(f"attempt_{attempt}", store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timeout,
    )


def check_sharded_launch(accelerator) -> None:
    """A script that applies its strategy itself refuses a launch that also asks Accelerate for
    one (it would shard twice on GPUs, and be silently dropped on CPU: docs/troubleshooting.md,
    "Accelerate's FSDP config is ignored on CPU"), and fp16, whose loss scaler does not handle
    sharded gradients."""
    sharded = launcher_sharding()
    if sharded:
        raise UsageError(
            f"this script applies its strategy itself with PyTorch's APIs, but the launch also asked Accelerate for "
            f"{sharded}: launch with a plain multi-process config, e.g. --config_file "
            "accelerate_configs/cpu_multi.yaml (or gpu_multi.yaml)"
        )
    if accelerator.mixed_precision == "fp16":
        raise UsageError(
            "--mixed_precision fp16 is not supported by the sharded strategies (its loss scaler does not handle "
            "sharded gradients): launch with --mixed_precision bf16 or no"
        )


def init_one_process_group(accelerator) -> None:
    """A DeviceMesh needs a process group, but `python scripts/X.py` and a one-process launch
    create none (Accelerate needs none for one process): make a one-process group, in memory
    (docs/troubleshooting.md, "A sharded script run as one process")."""
    if torch.distributed.is_initialized():
        return
    backend = "cpu:gloo,cuda:nccl" if accelerator.device.type == "cuda" else "gloo"
    torch.distributed.init_process_group(
        backend,
        store=torch.distributed.HashStore(),
        rank=0,
        world_size=1,
        device_id=accelerator.device if accelerator.device.type == "cuda" else None,
    )


# Every DeviceMesh built in this process (Layout.build_mesh adds them), for release_process_groups().
BUILT_MESHES: list = []


def release_process_groups() -> None:
    """Free the process groups that the meshes hold, now, while Python is fully alive.

    destroy_process_group() shuts every group down and forgets it, but a DeviceMesh keeps its
    groups' ProcessGroup objects in its own registry (sub-meshes use their root's), and DTensor's
    module-level caches keep the meshes. Left alone, those objects are freed only while the
    interpreter shuts down, and gloo's C++ teardown then sometimes aborted the finished run
    ("terminate called without an active exception", docs/fault-tolerance.md, "Clean exits").
    Call it after destroy_process_group()."""
    for mesh in BUILT_MESHES:
        mesh._pg_registry.clear()  # sub-meshes, flattened ones included, register in their root's
    BUILT_MESHES.clear()
    gc.collect()  # the groups' last references may sit in reference cycles
