"""Which peer a rank lost (faults.lost_peer_line's sentence), from the records every rank gathered at
set-up (peer_records.PEERS) and /proc: with no collective (they are broken by then) and no network. Imported
only by a run that lost a peer, or that a launcher ended (faults.line_on_sigterm)."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import torch

from . import peer_records
from .run_state import RunPosition

SURVIVOR_MARK = "survivor_rank{rank}.pid"  # in OUTPUT_DIR/logs: a rank that saw a lost peer, not a lost one


def _mark_survivor() -> Path | None:
    """OUTPUT_DIR/logs/survivor_rank<r>.pid, before this rank looks at its peers (and long before it
    exits): a peer that finds this rank's process gone then knows it left as a survivor."""
    if not peer_records.PEERS or not RunPosition.output_dir:
        return None
    logs = Path(RunPosition.output_dir) / "logs"
    try:
        logs.mkdir(parents=True, exist_ok=True)
        (logs / SURVIVOR_MARK.format(rank=torch.distributed.get_rank())).write_text(f"{os.getpid()}\n")
    except OSError:
        return None
    return logs


def _left_as_survivor(logs: Path, peer: dict) -> bool:
    """The peer's process is gone and it marked itself a survivor: it saw the loss, it is not the lost one."""
    mark = logs / SURVIVOR_MARK.format(rank=peer["rank"])
    try:
        return mark.read_text().strip() == str(peer["pid"]) and mark.stat().st_mtime >= RunPosition.started
    except OSError:
        return False


PF_EXITING = 0x4  # /proc/<pid>/stat's flags: the kernel is ending the process


def _settled_stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields, waiting up to a second for a process being ended to become a zombie: the
    kernel closes its sockets (how its peers learn it died) before it records how the process ended."""
    for _ in range(100):
        stat = peer_records.proc_stat(pid)
        if stat is None or stat[0] in "ZX" or not int(stat[6]) & PF_EXITING:
            return stat
        time.sleep(0.01)
    return stat


def state_of(peer: dict) -> tuple[str, str] | None:
    """What /proc says of a peer's process: ("gone", how, where it is not reaped yet), ("stopped", ""), or None
    (running or waiting: it may be a survivor still writing its own line)."""
    stat = _settled_stat(peer["pid"])
    if stat is None or (peer["started"] is not None and stat[19] != peer["started"]):
        return "gone", ""  # reaped by the launcher already, or its pid since taken by another process
    if stat[0] in "ZX":  # ended, not reaped yet: its exit status is still there
        status = int(stat[49])
        how = f"killed by {signal.Signals(status & 0x7F).name}" if status & 0x7F else f"exit code {status >> 8}"
        return "gone", f", {how}"
    if int(stat[6]) & PF_EXITING:
        return "gone", ""  # still being ended after a second (a large process frees its memory first)
    if stat[0] in "Tt":
        return "stopped", ""
    return None


def named_peers(error: BaseException) -> str:
    """ " Rank 1 (pid 4242 on host a) is gone." for the peers on this machine (its pid space) whose process is
    gone or stopped, and " Gloo's peer 10.0.0.2 is rank 3 (host b)." where the address in gloo's message is
    held by the ranks of one other host only. Never a guess: "" where nothing is known. A survivor that left
    first is told apart by its mark (_mark_survivor), so it is not named."""
    try:
        return _peer_sentences(error) if peer_records.PEERS and torch.distributed.is_initialized() else ""
    except Exception:  # an error path: the line must come out whatever /proc or the disk says
        return ""


def _peer_sentences(error: BaseException) -> str:
    rank = torch.distributed.get_rank()
    every, me = peer_records.PEERS, peer_records.PEERS[rank]
    beside = me["pid_space"] is not None and any(p["pid_space"] == me["pid_space"] for p in every if p is not me)
    logs = _mark_survivor() if beside else None  # only the ranks of this machine look for the mark
    found: dict[str, list[str]] = {"gone": [], "stopped": []}
    named = set()
    for peer in every:
        if peer is me or not beside or peer["pid_space"] != me["pid_space"]:
            continue
        state = state_of(peer)  # read before the mark: a survivor marks itself before it exits
        if state is None or (state[0] == "gone" and (logs is None or _left_as_survivor(logs, peer))):
            continue
        named.add(peer["rank"])
        found[state[0]].append(f"{peer['rank']} (pid {peer['pid']} on host {peer['host']}{state[1]})")
    sentences = []
    if len(found["gone"]) == 1:
        sentences.append(f" Rank {found['gone'][0]} is gone.")
    elif found["gone"]:  # which went first is not known here (a launcher ends its other workers when one fails)
        sentences.append(
            f" Ranks {', '.join(found['gone'][:-1])} and {found['gone'][-1]} are gone (a launcher ends its other"
            ' workers when one fails: its "Root Cause (first observed failure)" names the first).'
        )
    if found["stopped"]:
        ranks = found["stopped"]
        listed = f"Rank {ranks[0]} is" if len(ranks) == 1 else f"Ranks {', '.join(ranks[:-1])} and {ranks[-1]} are"
        sentences.append(f" {listed} stopped (SIGSTOP or a debugger).")
    address = re.search(r"\[(\d+\.\d+\.\d+\.\d+|[0-9a-fA-F:]*:[0-9a-fA-F:]*)\]:\d+", str(error))
    if address and not address[1].startswith("127.") and address[1] != "::1":
        holders = [p for p in every if address[1] in p["addresses"]]
        hosts = {p["net_space"] for p in holders}
        if len(hosts) == 1 and None not in hosts and me not in holders and not named & {p["rank"] for p in holders}:
            ranks = [str(p["rank"]) for p in holders]
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"one of ranks {', '.join(ranks)}"
            sentences.append(f" Gloo's peer {address[1]} is {who} (host {holders[0]['host']}).")
    return "".join(sentences)
