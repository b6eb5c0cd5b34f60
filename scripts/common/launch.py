"""Launching a training run: the Accelerator with the CPU traps handled and the launch-trap checks,
the process groups a run makes and ends (and what else its end releases: run_state.RELEASE_AT_END),
`run_main`, which turns bad input into one line, and record_peers, the guard line that lets a rank that
loses a peer name it."""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
from contextlib import contextmanager
from datetime import timedelta

import torch
from accelerate.utils import get_int_from_env

from .errors import NothingToDo, UsageError, off_the_bar
from .run_state import RELEASE_AT_END, RunPosition

# Where launchers put how many processes they started (torchrun WORLD_SIZE, mpirun PMI_SIZE ...):
# get_int_from_env(WORLD_SIZE_VARS, 1), Accelerate's own reading of them.
WORLD_SIZE_VARS = ["WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"]


def run_main(main) -> None:
    """Run `main()`: a UsageError is one line on stderr and exit 2; a collective that fails because a peer
    froze or died is one line naming the step (exit 1). Every way out ends the process groups first
    (docs/fault-tolerance.md, "Clean exits")."""
    try:
        main()
    except UsageError as e:
        from .faults import report_to_launcher, wait_for_rank0_to_report  # the ways a failing run reports

        if int(os.environ.get("RANK", "0")) != 0 and get_int_from_env(WORLD_SIZE_VARS, 1) > 1:
            wait_for_rank0_to_report()
        print(f"{off_the_bar()}error: {e}", file=sys.stderr, flush=True)
        report_to_launcher(f"error: {e}")
        end_process_groups()
        sys.exit(2)
    except NothingToDo as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(str(e), flush=True)
        end_process_groups()
        sys.exit(0)
    except BaseException as e:  # CheckpointException (a peer lost during a save) is a BaseException
        from .faults import keep_traceback, lost_peer_line, report_to_launcher  # a failing run's lines

        line = lost_peer_line(e)
        if line is None:
            keep_traceback(e)  # the peers' lost-peer lines point at it: this rank's is not lost in their output
            raise
        # every rank that saw it says so (the one that froze or died may be rank 0)
        print(off_the_bar() + line, file=sys.stderr, flush=True)
        report_to_launcher(line)
        sys.stdout.flush()
        os._exit(1)  # tearing the process group down could wait for the lost peer
    end_process_groups()


def end_process_groups() -> None:
    """Destroy the process group where the run has not, then free the groups the meshes still hold: left
    to the interpreter's shutdown, gloo's teardown aborted one finished run in 25 (layout.py)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    for release in RELEASE_AT_END:  # the groups that device meshes hold (common/layout.py), the output lock
        release()
    gc.collect()  # the groups' last references may sit in reference cycles
    # Nothing is garbage now: move every object to the permanent generation, so the interpreter's
    # shutdown does not walk the ~3M objects that torch's modules create once more (~1 s a process).
    gc.freeze()


def check_launch() -> None:
    """`accelerate launch --cpu --num_processes 2` (or MULTI_CPU without an mpirun hostfile) starts ONE
    process, with MASTER_ADDR and ACCELERATE_USE_CPU set but no WORLD_SIZE (docs/troubleshooting.md,
    "Only one process started")."""
    asked_for_more = "MASTER_ADDR" in os.environ and "ACCELERATE_USE_CPU" in os.environ
    if asked_for_more and get_int_from_env(WORLD_SIZE_VARS, 1) == 1:
        raise UsageError(
            "accelerate launch was asked for several processes but started only one (a --cpu or MULTI_CPU launch "
            "without an mpirun hostfile does that): use --config_file accelerate_configs/cpu_multi.yaml, "
            "or --multi_gpu --num_processes N"
        )


def make_accelerator(args, cpu: bool | None = None, sharded: bool = False, **accelerator_kwargs):
    """The Accelerator, with the CPU traps handled: without CUDA it runs on the CPU, so N launched processes
    join one gloo group (else each trains alone: docs/troubleshooting.md, "Several processes that each
    think they are alone"), and a dead peer fails the run after --collective_timeout s."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    check_launch()
    expected = get_int_from_env(WORLD_SIZE_VARS, 1)
    if "OMP_NUM_THREADS" not in os.environ:  # torchrun sets it to 1; a plain `python` run shares the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))))
    use_cpu = cpu if cpu is not None else (args.cpu or not torch.cuda.is_available())
    RunPosition.collective_timeout, RunPosition.output_dir = args.collective_timeout, args.output_dir
    RunPosition.started = time.time()
    init_restart_safe_group(use_cpu, timedelta(seconds=args.collective_timeout))
    handlers = [InitProcessGroupKwargs(timeout=timedelta(seconds=args.collective_timeout))]
    handlers += accelerator_kwargs.pop("kwargs_handlers", [])
    trackers = None if args.report_to == "none" else args.report_to
    accelerator = Accelerator(
        cpu=use_cpu, log_with=trackers, project_dir=args.output_dir, kwargs_handlers=handlers, **accelerator_kwargs
    )
    if accelerator.num_processes != expected:  # never N silent single-process runs
        raise UsageError(
            f"the launcher started {expected} processes but they did not join one group (each sees "
            f"{accelerator.num_processes}): launch with accelerate launch --config_file "
            "accelerate_configs/cpu_multi.yaml"
        )
    if sharded:  # the script applies its strategy itself, on a device mesh (common/sharded.py)
        from .sharded import check_sharded_launch, init_one_process_group

        check_sharded_launch(accelerator)
        init_one_process_group(accelerator)
    return accelerator


def record_peers(accelerator) -> None:
    """Collective: every rank learns who every rank is (rank, host, pid: common/peer_records.py), so that a rank
    that loses a peer names it (faults.lost_peer_line). One process has no peer: nothing is gathered, or imported."""
    if accelerator.num_processes > 1:
        from .peer_records import gather_peer_records

        gather_peer_records()


def init_restart_safe_group(use_cpu: bool, timeout: timedelta) -> None:
    """torchrun's key-value store outlives a restart (--max_restarts): new workers would find the dead ones'
    addresses ("Gloo connectFullMesh failed"). So the group is made on a view of it named after the attempt
    and the world size (a node joining an elastic run restarts the workers without counting an attempt)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or torch.distributed.is_initialized():
        return
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = torch.distributed.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = torch.distributed.PrefixStore(f"attempt_{attempt}_of_{world_size}", store)
    with connect_deadline(timeout.total_seconds()):
        torch.distributed.init_process_group(
            "gloo" if use_cpu else "nccl", store=store, rank=rank, world_size=world_size, timeout=timeout
        )


@contextmanager
def connect_deadline(seconds: float):
    """init_process_group within `seconds`, or one line and exit 1. gloo raises by itself on the rank that
    cannot connect out, but the rank waiting for that connection can wait far longer than its timeout
    (100 s for a timeout of 20, torch 2.13): a timer makes every rank give up in time."""

    def give_up():
        from .faults import report_to_launcher, unreachable_peers_line  # only a group that cannot connect

        line = unreachable_peers_line(f"not connected after {seconds:g} s")
        print(line, file=sys.stderr, flush=True)
        report_to_launcher(line)
        os._exit(1)  # the main thread is inside gloo's connect: nothing else can end it

    timer = threading.Timer(seconds, give_up)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
