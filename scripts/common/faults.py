"""How a run that fails says so: the one line for a collective that failed because a peer froze or
died (gloo's and DCP's messages read here), naming that peer where it can be known (common/peers.py,
from the records of common/peer_records.py), the one line for a process group that could not connect
because gloo listens on an interface the other nodes cannot reach, the line written for the
launcher's failure table (TORCHELASTIC_ERROR_FILE), the traceback a rank that crashed keeps, the grace
a rank gives rank 0 to report a bad-input error, and the line of a job a launcher ended (line_on_sigterm,
evaluate.py's). A training run imports it only when it fails (launch.run_main; launch.connect_deadline,
when its process group cannot connect in time)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

import torch

from .errors import off_the_bar
from .peer_records import interface_addresses
from .run_state import RunPosition

# How long a rank other than 0 waits, after a bad-input error, for rank 0 to report it.
USAGE_ERROR_GRACE_S = 20.0


def wait_for_rank0_to_report() -> None:
    """Most bad input fails the same check on every rank, and rank 0 says so once. A rank that
    exited first would make the launcher stop rank 0 before it printed its line, so the others
    wait: when rank 0 exits the launcher ends them (default SIGTERM, not the preemption
    handler). A rank still alive after the grace period saw an error of its own and prints it."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    time.sleep(USAGE_ERROR_GRACE_S)


# What gloo says when a peer stops answering (--collective_timeout passed) or goes away.
TIMEOUT_SIGNS = ("timed out", "timeout caused pair closure", "timeout waiting", "socket timeout")
GONE_SIGNS = ("connection closed by peer", "connection reset by peer", "broken pipe", "read error", "socket closed")


# What gloo says when the full mesh of a new process group cannot be connected (init_process_group).
CONNECT_SIGNS = ("connectfullmesh failed", "connect timeout", "timed out connecting")


def lost_peer_line(error: BaseException) -> str | None:
    """The one line for a collective that failed because a peer froze or died, or None if `error`
    is something else. It names the step (RunPosition), the collective the process waited in and
    where, and the troubleshooting section. A process group that could not connect gets
    unreachable_peers_line instead: the interface, not a peer, is the usual cause."""
    from torch.distributed.checkpoint.api import CheckpointException

    if not isinstance(error, (RuntimeError, CheckpointException)):
        return None
    text = str(error).lower()
    if any(sign in text for sign in CONNECT_SIGNS):
        return unreachable_peers_line(_gloo_detail(error))
    if any(sign in text for sign in TIMEOUT_SIGNS):
        seconds = f"{RunPosition.collective_timeout:g} s" if RunPosition.collective_timeout else "too long"
        what = f"waited {seconds} for a peer that did not answer (it froze, was stopped, or is far too slow)"
    elif any(sign in text for sign in GONE_SIGNS):
        what = "lost its connection to a peer (it died or was killed: its own output says why)"
    else:
        return None
    rank = f"rank {torch.distributed.get_rank()}" if torch.distributed.is_initialized() else "this process"
    again = "Continue with --resume_from_checkpoint auto" if RunPosition.output_dir else "Run it again"  # evaluate.py
    return (
        f"error: {RunPosition.describe()}: {collective_waited_for(error)} {what}; seen by {rank}"
        f" ({_gloo_detail(error)}).{_named_peers(error)}{_kept_tracebacks()} {again} once every process can run"
        ' (docs/troubleshooting.md, "A peer did not answer, or was lost")'
    )


def _named_peers(error: BaseException) -> str:
    from .peers import named_peers  # imported only by a run that lost a peer

    return named_peers(error)


def _kept_tracebacks() -> str:
    """ " The peer that crashed kept its traceback in: ..." where one did (keep_traceback)."""
    logs = Path(RunPosition.output_dir) / "logs" if RunPosition.output_dir else None
    kept = sorted(logs.glob("traceback_rank*.txt")) if logs and logs.is_dir() else []
    kept = [path for path in kept if path.stat().st_mtime >= RunPosition.started - 60]  # this run's (clocks differ)
    return f" The peer that crashed kept its traceback in: {', '.join(map(str, kept))}." if kept else ""


def _gloo_detail(error: BaseException) -> str:
    """gloo's own words, without its source locations ("[.../unbound_buffer.cc:78] Timed out ...")."""
    first = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip().splitlines()[0] if str(error).strip() else "")
    return re.sub(r"\[[^\]]*\.(cc|h|cpp):\d+\]\s*", "", first).strip()[:160] or type(error).__name__


def interface_of(address: str | None) -> str | None:
    """The interface that holds `address` (a 127.x address: the loopback's)."""
    if address and address.startswith("127."):
        return next((n for n, a in interface_addresses().items() if a.startswith("127.")), "lo")
    return next((n for n, a in interface_addresses().items() if a == address), None)


def route_address(host: str) -> str | None:
    """This host's address on the route to `host`: a UDP connect sends nothing, the kernel picks the route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 1))
            return s.getsockname()[0]
        except OSError:
            return None


def gloo_address() -> tuple[str | None, str]:
    """(address, how) gloo listens on: GLOO_SOCKET_IFNAME's interface, else what the host name
    resolves to (ProcessGroupGloo's createDefaultDevice: it takes that address if it can bind to it)."""
    wanted = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if wanted:
        return interface_addresses().get(wanted), f"GLOO_SOCKET_IFNAME={wanted}"
    try:
        return socket.gethostbyname(socket.gethostname()), f"the address host name {socket.gethostname()} resolves to"
    except OSError:
        return None, f"host name {socket.gethostname()} does not resolve, so the loopback"


def unreachable_peers_line(detail: str) -> str:
    """The one line for a process group whose ranks could not connect (gloo's full mesh at
    init_process_group). Across nodes the usual cause is the interface: without GLOO_SOCKET_IFNAME gloo
    listens on the address of the host name, which may be a network the other nodes are not on (a Docker
    bridge, a VPN, a second card). The interface to use is the one that reaches the rendezvous (MASTER_ADDR),
    which every node reached already."""
    rank = os.environ.get("RANK", "?")
    master = os.environ.get("MASTER_ADDR", "")
    address, how = gloo_address()
    used = interface_of(address)
    right_address = route_address(master) if master else None
    right = interface_of(right_address)
    several_nodes = os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE")) != os.environ.get("WORLD_SIZE")
    where = f"rank {rank} (host {socket.gethostname()})"
    start = f"error: {RunPosition.describe()}: {where} could not connect to the other ranks ({detail})"
    section = '(docs/troubleshooting.md, "The process group cannot connect: set GLOO_SOCKET_IFNAME")'
    if several_nodes and right and used != right:
        return (
            f"{start}: gloo listens on {address} ({how}, interface {used or '?'}), which the other nodes cannot "
            f"reach; this node reaches the rendezvous {master} through {right}: set GLOO_SOCKET_IFNAME={right} "
            f"(NCCL_SOCKET_IFNAME={right} on GPUs) on every node, each to its own interface of that network {section}"
        )
    return (
        f"{start}: gloo listens on {address} ({how}, interface {used or '?'}); if that is the network the nodes "
        "share, a peer did not start, the link between the nodes is down or a firewall blocks gloo's ports; else "
        "set GLOO_SOCKET_IFNAME "
        f"(NCCL_SOCKET_IFNAME on GPUs) to the interface that reaches the rendezvous {master} {section}"
    )


def collective_waited_for(error: BaseException) -> str:
    """Which collective the process was waiting in, and where in our code, from the traceback: the
    innermost torch.distributed call; else backward (DDP's gradient all-reduce runs in C++ hooks);
    else what StepFeed said it was waiting for (an asynchronous all-reduce's wait())."""
    frames = traceback.extract_tb(error.__traceback__)
    scripts_dir = str(Path(__file__).resolve().parents[1])
    ours = [f for f in frames if f.filename.startswith(scripts_dir)]
    where = f" at {Path(ours[-1].filename).name}:{ours[-1].lineno}" if ours else ""
    c10d = [f.name for f in frames if f.filename.endswith("distributed_c10d.py") and not f.name.startswith("_")]
    torch_dist = [f.name for f in frames if f"{os.sep}torch{os.sep}distributed{os.sep}" in f.filename]
    if c10d:
        name = c10d[-1]
    elif any(f"{os.sep}torch{os.sep}autograd{os.sep}" in f.filename for f in frames):
        name = "all_reduce (gradient sync in backward)"
    elif RunPosition.waiting:
        name = RunPosition.waiting
    elif torch_dist:
        name = f"a collective (in torch.distributed's {torch_dist[-1]})"
    else:
        name = "a collective"
    return name + where


def report_to_launcher(message: str) -> None:
    """Under torchrun (and `accelerate launch`, which runs torchrun), a failed worker ends in the
    launcher's traceback and failure table. The table shows what the worker wrote to its
    TORCHELASTIC_ERROR_FILE: writing our one line there makes the table's last lines repeat it,
    instead of "To enable traceback see: ..." (docs/troubleshooting.md, "A traceback after the error line")."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        try:
            with open(path, "w") as f:
                json.dump({"message": message, "timestamp": int(time.time())}, f)
        except OSError:
            pass


def keep_traceback(error: BaseException) -> None:
    """An unexpected exception on a rank: its traceback in OUTPUT_DIR/logs/traceback_rank<r>.txt, said on
    stderr (the peers that lose this rank print one line each, and name the file)."""
    if RunPosition.output_dir is None or isinstance(error, (KeyboardInterrupt, SystemExit)):
        return
    path = Path(RunPosition.output_dir) / "logs" / f"traceback_rank{os.environ.get('RANK', '0')}.txt"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(traceback.format_exception(error)))
    except OSError:
        return
    print(f"rank {os.environ.get('RANK', '0')} failed; its traceback is kept in {path}", file=sys.stderr, flush=True)


def line_on_sigterm() -> None:
    """For a job with no preemption handler (evaluate.py): the launcher ends every process with SIGTERM when
    one fails, which would end this one in silence; it says so in one line instead, naming a peer found gone."""

    def ended(signum, frame):
        line = (
            f"error: {Path(sys.argv[0]).name} was ended by SIGTERM: a launcher ends every process when one fails"
            f' (its "Root Cause" names that one), or the job was stopped.{_named_peers(RuntimeError())}'
        )
        print(off_the_bar() + line, file=sys.stderr, flush=True)
        report_to_launcher(line)
        os._exit(1)  # tearing the process group down could wait for the lost peer

    signal.signal(signal.SIGTERM, ended)
