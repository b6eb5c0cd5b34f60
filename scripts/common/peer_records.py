"""Who every rank is (rank, host, pid, ...): gathered once at set-up (gather_peer_records, started by
the script's launch.record_peers line on more than one process), so that a rank that loses a peer
names it (common/peers.py, through faults.lost_peer_line) from these records and from /proc, with no
collective (they are broken by then) and no network. Each network interface's address
(interface_addresses): its own record's, and faults' line for a process group that cannot connect."""

from __future__ import annotations

import fcntl
import os
import socket
import struct
from pathlib import Path

import torch

PEERS: list[dict] = []  # every rank's record, in rank order (gather_peer_records)


def _namespace(kind: str) -> str | None:
    """The machine (its boot id) and this process's `kind` namespace ("pid", "net"): a pid, or an address,
    means the same process, or host, only to processes that share it. None off Linux."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.stat(f'/proc/self/ns/{kind}').st_ino}"
    except OSError:
        return None


def proc_stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields from the third (the state) on; None where no such process is left."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def this_process() -> dict:
    """This rank's record: who it is and where, as its peers will look for it."""
    stat = proc_stat(os.getpid())
    return {
        "rank": torch.distributed.get_rank(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": stat[19] if stat else None,  # clock ticks after boot: a pid taken again later differs
        "pid_space": _namespace("pid"),
        "net_space": _namespace("net"),
        "addresses": sorted(a for a in interface_addresses().values() if not a.startswith("127.")),
    }


def gather_peer_records() -> None:
    """Every rank learns every rank's record: one small all_gather at set-up, nothing per step."""
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        gathered = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, this_process())
        PEERS[:] = gathered


def interface_addresses() -> dict[str, str]:
    """Each network interface's IPv4 address (Linux; interfaces without one are left out)."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                request = struct.pack("256s", name[:15].encode())
                found[name] = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, request)[20:24])  # SIOCGIFADDR
            except OSError:
                pass
    return found
