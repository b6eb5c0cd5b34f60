#!/usr/bin/env python
r"""Preflight: before a long job, check that all its ranks meet, reach each other, and how fast they talk.

Run it with the job's own launcher and configuration. Every step has a deadline (--timeout), so a
rank that is missing, unreachable, dead or frozen ends the check with one `error:` line naming it,
never with a hang:

    1. join        every rank reaches the rendezvous (MASTER_ADDR:MASTER_PORT) and checks in;
                   rank 0 prints who is where: host, node, rank, device, network address
    2. reach       on several nodes, each rank opens a TCP connection to a peer on every other
                   node, at the address its collectives will use (GLOO/NCCL_SOCKET_IFNAME)
    3. measure     all-reduce, all-gather and send/recv, timed for a few sizes, in three scopes:

                   node 0: [r0 r1]    node 1: [r2 r3]
                   intra_node = {r0,r1} {r2,r3}    inter_node = {r0,r2} {r1,r3}    world = all

    4. write       --output (a JSON file that `scripts/plan_layout.py --network` reads)

Run it:
    accelerate launch --config_file accelerate_configs/cpu_multi.yaml scripts/preflight.py     # 2 CPU processes
    accelerate launch --config_file accelerate_configs/gpu_multi.yaml scripts/preflight.py     # all GPUs of a node
    accelerate launch --config_file accelerate_configs/multi_node.yaml --rdzv_conf timeout=60 scripts/preflight.py
    torchrun --nnodes 2 --nproc_per_node 8 --node_rank 0 --master_addr 10.0.0.1 --master_port 29500 \
        --rdzv_conf timeout=60 scripts/preflight.py                    # and the same on node 1 with --node_rank 1
Under torchrun (which accelerate launch runs) the launcher joins the machines before any process
starts: `--rdzv_conf timeout=S` bounds that wait too. Bandwidths follow the NCCL tests: algbw =
bytes / time; busbw = algbw x 2(n-1)/n for all-reduce, x (n-1)/n for all-gather, x 1 for send/recv.
"""

import argparse
import fcntl
import json
import os
import re
import socket
import struct
import sys
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts run as files: make `common` importable

import torch
import torch.distributed as dist
from accelerate.utils import get_int_from_env

from common.cli import HelpFormatter
from common.errors import UsageError
from common.faults import interface_of, report_to_launcher, route_address
from common.launch import WORLD_SIZE_VARS, check_launch, run_main

FORMAT = "preflight/1"
CPU_SIZES, GPU_SIZES = "4K,256K,4M", "1M,16M,256M"
WARMUP_CALLS = 2  # untimed calls before each measurement
BEAT_SECONDS = 0.5  # how often each rank tells the store it is alive
SCOPES = ("intra_node", "inter_node", "world")
OPS = ("all_reduce", "all_gather", "send_recv")
BUS_FACTOR = {  # NCCL tests: the share of the data that crosses each rank's link
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "send_recv": lambda n: 1.0,
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--output", default="preflight.json", help="the JSON file to write (rank 0)")
    p.add_argument(
        "--sizes",
        help=f"message sizes in bytes, comma-separated, K/M/G suffixes allowed (default: {CPU_SIZES} on CPU, "
        f"{GPU_SIZES} on GPU)",
    )
    p.add_argument("--iters", type=int, help="timed repetitions of each operation (default: 5 on CPU, 20 on GPU)")
    p.add_argument(
        "--timeout",
        type=float,
        default=60,
        help="seconds every step may take (joining, set-up, each measurement) before the check fails",
    )
    p.add_argument("--cpu", action="store_true", help="check the CPU (gloo) even where CUDA exists")
    return p


def parse_size(text: str) -> int:
    """'4096', '4K', '4KiB', '16M', '1G' -> bytes (binary units)."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    given = text.strip()
    number = given.upper().removesuffix("B").removesuffix("I")
    scale = units.get(number[-1:], 1)
    try:
        size = int(float(number.rstrip("KMG")) * scale)
    except ValueError:
        raise UsageError(f"--sizes: {given!r} is not a size: give bytes like 4096, 4K, 16M or 1G") from None
    if size < 4:
        raise UsageError(f"--sizes: {given!r} is below 4 bytes, one float32")
    return size


def check_args(args, on_gpu: bool) -> None:
    args.sizes = sorted({parse_size(s) for s in (args.sizes or (GPU_SIZES if on_gpu else CPU_SIZES)).split(",")})
    args.iters = args.iters if args.iters is not None else (20 if on_gpu else 5)
    if args.iters < 1:
        raise UsageError(f"--iters must be at least 1 (got {args.iters})")
    if args.timeout <= 0:
        raise UsageError(f"--timeout must be positive seconds (got {args.timeout})")
    if Path(args.output).is_dir():
        raise UsageError(f"--output {args.output} is a folder: give a file name such as preflight.json")
    if int(os.environ.get("RANK", "0")) == 0:  # the writer: find out now, not after all the measurements
        try:
            Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"--output {args.output}: cannot create its folder ({e.strerror}): give a writable path")


def fail(message: str, show: bool = True) -> None:
    """End this process with one line (if `show`); the launcher's failure table repeats it."""
    if show:
        print(f"error: {message}", file=sys.stderr, flush=True)
    report_to_launcher(f"error: {message}")
    sys.stdout.flush()
    os._exit(1)  # not sys.exit: a half-built process group can wait on peers while it is torn down


# ----------------------------------------------------------------------------- who am I
def launch_from_env() -> dict:
    """What the launcher told this process. torchrun (and accelerate launch) set RANK, LOCAL_RANK,
    LOCAL_WORLD_SIZE and GROUP_RANK (the node); a launch of one process per rank (srun, mpirun)
    sets RANK and WORLD_SIZE, and NODE_RANK or SLURM_NODEID if it knows the node."""
    world_size = get_int_from_env(WORLD_SIZE_VARS, 1)  # Accelerate's reading of the launcher's variables
    node = next((os.environ[v] for v in ("GROUP_RANK", "NODE_RANK", "SLURM_NODEID") if v in os.environ), None)
    rank = int(os.environ.get("RANK", "0"))
    # under torchrun the launcher's agent holds the store; otherwise rank 0 serves it
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return {
        "rank": rank,
        "world_size": world_size,
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in os.environ else None,
        "node": int(node) if node is not None else None,
        "host": socket.gethostname(),
        "master": (os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))),
        "agent_store": agent_store,
        "serves_store": rank == 0 and not agent_store and world_size > 1,
    }


def interface_address(name: str) -> str | None:
    """The IPv4 address of a network interface (Linux), None if there is no such interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            request = struct.pack("256s", name[:15].encode())
            return socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, request)[20:24])  # SIOCGIFADDR
        except OSError:
            return None


def network_address(backend: str, master: tuple[str, int], rank: int) -> tuple[str, str]:
    """(address, how it was chosen): where this rank's collectives listen. Gloo takes
    GLOO_SOCKET_IFNAME, else the address its host name resolves to; NCCL takes NCCL_SOCKET_IFNAME
    (name prefixes), else picks an interface itself: we report the one that routes to MASTER_ADDR."""
    variable = "GLOO_SOCKET_IFNAME" if backend == "gloo" else "NCCL_SOCKET_IFNAME"
    wanted = os.environ.get(variable, "").split(",")[0].strip()
    if wanted and not wanted.startswith("^"):
        exact = backend == "gloo" or wanted.startswith("=")
        names = [n for _, n in socket.if_nameindex()]
        matching = [n for n in names if n == wanted.lstrip("=") or (not exact and n.startswith(wanted))]
        address = next((a for a in map(interface_address, matching) if a), None)
        if address is None:
            fail(
                f"rank {rank} (host {socket.gethostname()}): {variable}={wanted} names no interface with an IPv4 "
                f"address on this host (it has: {', '.join(names)}): set {variable} to the interface of the "
                "network the machines share"
            )
        return address, f"{variable}={wanted}"
    if backend == "gloo":
        try:
            return socket.gethostbyname(socket.gethostname()), "host name"
        except OSError:
            pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(master)  # UDP: no packet is sent, the kernel only picks the route
            return s.getsockname()[0], f"route to {master[0]}"
        except OSError:
            return "?", "no route"


def device_of(launch: dict, use_cpu: bool) -> tuple[torch.device, str]:
    if use_cpu:
        return torch.device("cpu"), f"{os.cpu_count()} cores"
    device = torch.device("cuda", launch["local_rank"] % torch.cuda.device_count())
    return device, torch.cuda.get_device_name(device)


# ----------------------------------------------------------------------------- 1. join
def reach_rendezvous(launch: dict, deadline: float) -> None:
    """A plain TCP connection to MASTER_ADDR:MASTER_PORT first, retried until the deadline (rank 0
    may still be starting): its failure names this rank and what the network said."""
    host, port = launch["master"]
    last_error = "no answer"
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic()))).close()
            return
        except OSError as e:
            last_error = e.strerror or str(e) or type(e).__name__
            time.sleep(0.5)
    fail(
        f"rank {launch['rank']} (host {launch['host']}) cannot reach the rendezvous at {host}:{port} ({last_error}): "
        "check that MASTER_ADDR (--main_process_ip) is node 0's address as seen from this host, and that no "
        "firewall blocks the port"
    )


def connect_store(launch: dict, timeout: float) -> dist.Store:
    """The key-value store every rank shares: the launcher's under torchrun, else served by rank 0."""
    host, port = launch["master"]
    serve = launch["serves_store"]
    if not serve:
        reach_rendezvous(launch, time.monotonic() + timeout)
    try:
        store = dist.TCPStore(
            host, port, is_master=serve, timeout=timedelta(seconds=timeout), wait_for_workers=False, multi_tenant=True
        )
    except dist.DistError as e:  # rank 0: the port is taken; others: the connection broke after the test one
        role = (
            f"cannot serve the rendezvous on port {port}" if serve else f"cannot join the rendezvous at {host}:{port}"
        )
        fail(f"rank {launch['rank']} (host {launch['host']}) {role} ({short_reason(e)}): choose a free MASTER_PORT")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # a restart must not read the dead attempt's keys
    return dist.PrefixStore(f"preflight/attempt_{attempt}", store)


def describe_ranks(ranks: list[int], expected_per_node: int | None) -> str:
    """'rank 3' or 'ranks 2, 3' plus the node they belong to, when the launch says."""
    names = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    nodes = sorted({r // expected_per_node for r in ranks}) if expected_per_node else []
    return names + (f" (node {', '.join(map(str, nodes))})" if nodes else "")


def gather_on_store(store, phase: str, launch: dict, payload, timeout: float, missing: str) -> list:
    """Every rank's `payload`, through the store: each rank writes its own, rank 0 waits for all for
    `timeout` s, then publishes either the list or one line naming the ranks that never came
    (`missing` says what they failed to do and what to check)."""
    rank, world_size = launch["rank"], launch["world_size"]
    deadline = time.monotonic() + timeout
    store.set(f"{phase}/{rank}", json.dumps(payload))
    if rank == 0:
        keys = [f"{phase}/{r}" for r in range(world_size)]
        while not store.check(keys) and time.monotonic() < deadline:
            time.sleep(0.1)
        absent = [r for r in range(world_size) if not store.check([keys[r]])]
        if absent:
            message = f"{describe_ranks(absent, launch['local_world_size'])} {missing.format(timeout=f'{timeout:g}')}"
            store.set(f"{phase}/result", json.dumps({"error": message}))
            print(f"error: {message}", file=sys.stderr, flush=True)
            wait_for_readers(store, f"{phase}/read", world_size - len(absent) - 1, launch)
            fail(message, show=False)
        store.set(f"{phase}/result", json.dumps({"payloads": [json.loads(v) for v in store.multi_get(keys)]}))
    try:
        store.wait([f"{phase}/result"], timedelta(seconds=timeout + 10))
    except dist.DistError:
        fail(f"rank {rank} (host {launch['host']}): rank 0 did not answer at the rendezvous within {timeout + 10:g} s")
    result = json.loads(store.get(f"{phase}/result"))
    store.add(f"{phase}/read", 1)
    if "error" in result:
        fail(result["error"], show=False)  # rank 0 printed it
    return result["payloads"]


def wait_for_readers(store, counter: str, readers: int, launch: dict) -> None:
    """Rank 0 serves the store itself when no torchrun holds it: before it leaves on an error, the
    other ranks read the error (each adds 1 to `counter`), or they would report a vanished store instead."""
    until = time.monotonic() + 5
    while launch["serves_store"] and store.add(counter, 0) < readers and time.monotonic() < until:
        time.sleep(0.05)


NOT_JOINED = (
    "did not join within {timeout} s: check that every node was started with the same command (only the node "
    "rank differs), that each reaches MASTER_ADDR:MASTER_PORT, and the lines the missing ranks printed"
)


def assign_nodes(members: list[dict]) -> None:
    """Number the nodes 0..k-1 in rank order: by the launcher's node rank where it gives one (two
    'nodes' on one host stay two), else by host name. Local ranks follow the same grouping."""
    keys = [m["node"] if m["node"] is not None else m["host"] for m in members]
    order = list(dict.fromkeys(keys))
    seen: dict[int, int] = defaultdict(int)
    for member, key in zip(members, keys, strict=True):
        member["node"] = order.index(key)
        member["local_rank"] = seen[member["node"]]
        seen[member["node"]] += 1


# ----------------------------------------------------------------------------- deadlines
def short_reason(error: Exception) -> str:
    """The first sentence of a gloo/NCCL error, without the C++ source location in front."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip().splitlines()[0] if str(error).strip() else repr(error))
    return text.split(". ")[0][:160]


class Watchdog:
    """Every step runs under a deadline. A beat thread raises this rank's counter on the store every
    BEAT_SECONDS; when a step overruns (or fails because a peer dropped its connections), the ranks
    whose counters stopped are the dead or frozen ones, and the error line names them. torch's own
    timeout (set a little longer) is the backstop: NCCL's would kill the process with no such line."""

    def __init__(self, store, launch: dict, timeout: float):
        self.timeout, self.launch = timeout, launch
        self.members: list[dict] = []
        self.step_name: str | None = None
        self.deadline: float | None = None
        self.failing = threading.Lock()
        self.leaving = False
        self.beat_store = store.clone()  # a connection of its own: the main thread's may be blocked in a wait
        self.beat_store.set_timeout(timedelta(seconds=5))
        self.beat_store.add(f"beat/{launch['rank']}", 1)
        threading.Thread(target=self._beat, daemon=True).start()
        threading.Thread(target=self._watch, daemon=True).start()

    def leave(self) -> None:
        """Stop beating, then wait (briefly) for every rank to do the same, so that the rank serving
        the store is not gone while others still talk to it."""
        self.leaving = True
        time.sleep(BEAT_SECONDS)  # let a beat in flight finish
        self.beat_store.add("left", 1)
        until = time.monotonic() + 5
        while self.beat_store.add("left", 0) < self.launch["world_size"] and time.monotonic() < until:
            time.sleep(0.05)

    def _beat(self) -> None:
        while not self.leaving:
            try:
                self.beat_store.add(f"beat/{self.launch['rank']}", 1)
            except Exception:  # the store is gone: the step's deadline reports it
                pass
            time.sleep(BEAT_SECONDS)

    def _watch(self) -> None:
        while True:
            deadline = self.deadline
            if deadline is not None and time.monotonic() > deadline:
                self.fail(self.step_name, f"did not finish within {self.timeout:g} s")
            time.sleep(0.1)

    @contextmanager
    def step(self, name: str):
        self.step_name, self.deadline = name, time.monotonic() + self.timeout
        try:
            yield
        except Exception as e:  # a peer that died closes its connections: gloo raises at once
            self.fail(name, f"failed ({short_reason(e)})")
        finally:
            self.deadline = None

    def silent_ranks(self) -> list[int] | None:
        """Ranks whose beat counter did not move over a few beats; None if the store does not answer."""
        keys = [f"beat/{r}" for r in range(self.launch["world_size"])]
        try:
            before = self.beat_store.multi_get(keys)
            time.sleep(4 * BEAT_SECONDS)
            after = self.beat_store.multi_get(keys)
        except Exception:
            return None
        return [r for r, (a, b) in enumerate(zip(before, after, strict=True)) if a == b]

    def fail(self, step: str, what: str) -> None:
        """One line for the whole job: the first rank to diagnose writes it to the store, and on each
        node the lowest rank still alive prints it."""
        self.failing.acquire()  # the main thread and the watch thread may both get here: once is enough
        rank = self.launch["rank"]
        silent = self.silent_ranks()
        if silent is None:
            fail(
                f"rank {rank} (host {self.launch['host']}): {step} {what}, and the rendezvous store at "
                f"{self.launch['master'][0]}:{self.launch['master'][1]} does not answer: node 0 or its launcher "
                "is down"
            )
        silent = [r for r in silent if r != rank]
        if silent:
            who = ", ".join(f"rank {r} (host {self.host(r)})" for r in silent)
            cause = f"{who} stopped answering: dead or frozen"
        else:
            cause = "every rank is alive: the network between them is blocked or far too slow"
        verdict = json.dumps({"message": f"{step} {what}: {cause}", "silent": silent})
        try:
            self.beat_store.compare_set("failure", "", verdict)  # the first rank to get here writes the verdict
            verdict = self.beat_store.get("failure").decode()
            self.beat_store.add("failure/read", 1)
        except Exception:  # the store went away meanwhile: report what this rank saw
            pass
        message, silent = json.loads(verdict)["message"], json.loads(verdict)["silent"]
        wait_for_readers(self.beat_store, "failure/read", self.launch["world_size"] - len(silent), self.launch)
        node = self.node_of(rank)
        alive_here = [r for r in range(self.launch["world_size"]) if self.node_of(r) == node and r not in silent]
        fail(message, show=rank == min(alive_here, default=rank))

    def host(self, rank: int) -> str:
        return self.members[rank]["host"] if self.members else "?"

    def node_of(self, rank: int):
        return self.members[rank]["node"] if self.members else rank


# ----------------------------------------------------------------------------- 2. reach
def open_listener(address: str) -> socket.socket:
    """A socket on the address collectives will use, accepting (and dropping) peers' test connections."""
    listener = socket.socket()
    listener.bind((address, 0))
    listener.listen(64)

    def accept_forever():
        while True:
            connection, _ = listener.accept()
            connection.close()

    threading.Thread(target=accept_forever, daemon=True).start()
    return listener


def probe_peers(me: dict, members: list[dict], timeout: float) -> list[str]:
    """Connect to one rank on every other node (the same local rank where there is one). Returns one
    line per peer that could not be reached; where the peer's address is not on its route to the
    rendezvous, the line also says whether that route's interface reaches it."""
    peers = []
    for node in sorted({m["node"] for m in members} - {me["node"]}):
        on_node = [m for m in members if m["node"] == node]
        peers.append(next((m for m in on_node if m["local_rank"] == me["local_rank"]), on_node[0]))

    def reaches(address: str, port: int) -> str | None:
        try:
            socket.create_connection((address, port), timeout=timeout).close()
            return None
        except OSError as e:
            return e.strerror or str(e) or type(e).__name__

    def problem(peer: dict) -> str | None:
        error = reaches(peer["address"], peer["port"])
        if error is None:
            return None
        loopback = ", a loopback address other hosts cannot reach" if peer["address"].startswith("127.") else ""
        interface = f", interface {peer['interface']}" if peer.get("interface") else ""
        line = (
            f"rank {me['rank']} (host {me['host']}, node {me['node']}) cannot reach rank {peer['rank']} "
            f"(host {peer['host']}, node {peer['node']}) at {peer['address']}:{peer['port']} "
            f"({error}; address from {peer['address_from']}{interface}{loopback})"
        )
        if peer.get("route_port"):  # its collectives' address is not the one on its route to the rendezvous
            other = reaches(peer["route_address"], peer["route_port"])
            answer = "reaches it" if other is None else f"does not reach it either ({other})"
            line += f"; its {peer['route_interface']} ({peer['route_address']}) {answer}"
        return line

    with ThreadPoolExecutor(max_workers=16) as pool:  # all at once: each unreachable peer costs `timeout`
        return [line for line in pool.map(problem, peers) if line]


def interface_advice(members: list[dict], unreachable: list[str]) -> str | None:
    """When every unreachable peer answered on the interface of its route to the rendezvous: the
    GLOO_SOCKET_IFNAME to set, and on which nodes (those whose collectives' address is elsewhere)."""
    if not unreachable or not all(line.endswith(" reaches it") for line in unreachable):
        return None
    wrong = [m for m in members if m["route_port"]]
    by_interface: dict[str, list[int]] = defaultdict(list)
    for m in wrong:
        if m["node"] not in by_interface[m["route_interface"]]:
            by_interface[m["route_interface"]].append(m["node"])
    every = {m["node"] for m in wrong} == {m["node"] for m in members}
    fixes = [
        f"GLOO_SOCKET_IFNAME={name} (NCCL_SOCKET_IFNAME={name} on GPUs) on "
        + ("every node" if every and len(by_interface) == 1 else f"node {', '.join(map(str, nodes))}")
        for name, nodes in by_interface.items()
    ]
    source = wrong[0]["address_from"]
    return (
        f"the collectives' address ({source}) is on a network the other nodes cannot reach, and the interface "
        f"that reaches the rendezvous reaches them: set {'; '.join(fixes)}"
    )


# ----------------------------------------------------------------------------- 3. measure
def build_groups(members: list[dict]) -> dict[str, list[list[int]]]:
    """The rank lists of each scope. A scope whose groups all have one rank has nothing to measure."""
    nodes = sorted({m["node"] for m in members})
    local_ranks = sorted({m["local_rank"] for m in members})
    scopes = {
        "intra_node": [[m["rank"] for m in members if m["node"] == n] for n in nodes],
        "inter_node": [[m["rank"] for m in members if m["local_rank"] == lr] for lr in local_ranks],
        "world": [[m["rank"] for m in members]],
    }
    scopes = {name: groups for name, groups in scopes.items() if max(map(len, groups)) > 1}
    if "world" in scopes and any(groups == scopes["world"] for name, groups in scopes.items() if name != "world"):
        del scopes["world"]  # one node, or one rank per node: the world is one of the other scopes
    return scopes


def make_group_ops(group, ranks: list[int], rank: int, size: int, device) -> dict:
    """Each operation as a function of no arguments, on buffers of about `size` bytes (NCCL tests: for
    all-gather `size` is the gathered whole), and the bytes it really moves."""
    n = len(ranks)
    numel = max(1, size // 4)
    reduce_buffer = torch.ones(numel, device=device)
    per_rank = max(1, numel // n)
    gather_in, gather_out = torch.ones(per_rank, device=device), torch.empty(per_rank * n, device=device)
    send, receive = torch.ones(numel, device=device), torch.empty(numel, device=device)
    position = ranks.index(rank)
    next_rank, previous_rank = ranks[(position + 1) % n], ranks[(position - 1) % n]

    def send_recv():  # a ring: everyone sends to the next and receives from the previous at once
        ops = [dist.P2POp(dist.isend, send, next_rank, group), dist.P2POp(dist.irecv, receive, previous_rank, group)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()

    return {
        "all_reduce": (lambda: dist.all_reduce(reduce_buffer, group=group), 4 * numel),
        "all_gather": (lambda: dist.all_gather_single(gather_out, gather_in, group=group), 4 * per_rank * n),
        "send_recv": (send_recv, 4 * numel),
    }


def timed(operation, iters: int, device) -> float:
    """Mean seconds of one call, after warm-up calls that set up connections and buffers. On a GPU
    the clock stops after a synchronize: the calls only queue work."""
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    for _ in range(WARMUP_CALLS):
        operation()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        operation()
    synchronize(device)
    return (time.perf_counter() - start) / iters


def summarise(per_rank: list[list[dict]]) -> list[dict]:
    """One record per (op, scope, size): the slowest rank's time, since a collective ends for all when
    it ends for the last."""
    slowest: dict[tuple, dict] = {}
    for record in (r for records in per_rank for r in records):
        key = (record["op"], record["scope"], record["size"])
        if key not in slowest or record["seconds"] > slowest[key]["seconds"]:
            slowest[key] = record
    out = []
    for (op, scope, _), r in sorted(
        slowest.items(), key=lambda kv: (SCOPES.index(kv[0][1]), OPS.index(kv[0][0]), kv[0][2])
    ):
        algbw = r["bytes"] / r["seconds"] / 1e9
        out.append(
            {
                "op": op,
                "scope": scope,
                "bytes": r["bytes"],
                "seconds": r["seconds"],
                "algbw_GBps": algbw,
                "busbw_GBps": algbw * BUS_FACTOR[op](r["group_size"]),
                "group_size": r["group_size"],
            }
        )
    return out


def links_of(measurements: list[dict]) -> dict:
    """What a planner needs per scope: all-reduce bus bandwidth at the largest size, latency at the smallest;
    and the ring's point-to-point bandwidth (send/recv to the next rank, from the previous, at the largest
    size): what context parallelism's ring attention (train_cp.py) moves its K/V blocks over."""
    links = {}
    for scope in ("intra_node", "inter_node"):
        rows = sorted(
            (m for m in measurements if m["op"] == "all_reduce" and m["scope"] == scope), key=lambda m: m["bytes"]
        )
        links[scope] = (
            {"bandwidth_GBps": rows[-1]["busbw_GBps"], "latency_us": rows[0]["seconds"] * 1e6} if rows else None
        )
        ring = sorted(
            (m for m in measurements if m["op"] == "send_recv" and m["scope"] == scope), key=lambda m: m["bytes"]
        )
        if rows and ring:  # CP: the ring's point-to-point link
            links[scope]["ring_p2p_GBps"] = ring[-1]["busbw_GBps"]
    return links


def measure(scopes: dict[str, list[list[int]]], args, rank: int, device, watchdog) -> list[dict]:
    """This rank's timings: for each scope, size and operation, in the same order on every rank. The
    groups of a scope run side by side (every node's intra-node group at once), as a job's would."""
    my_groups = {}
    with watchdog.step("sub-group set-up (new_group)"):
        for scope, groups in scopes.items():
            for ranks in groups:  # every rank creates every group, in the same order
                group = dist.group.WORLD if len(ranks) == dist.get_world_size() else dist.new_group(ranks)
                if rank in ranks:
                    my_groups[scope] = (group, ranks)
    records = []
    for scope, (group, ranks) in my_groups.items():
        with watchdog.step(f"warm-up ({scope})"):  # a new group's first calls set up its connections
            for operation, _ in make_group_ops(group, ranks, rank, min(args.sizes), device).values():
                for _ in range(WARMUP_CALLS if len(ranks) > 1 else 0):
                    operation()
        for size in args.sizes:
            ops = make_group_ops(group, ranks, rank, size, device)
            for op in OPS:
                operation, moved = ops[op]
                with watchdog.step(f"{op} of {human_bytes(size)} ({scope})"):
                    if len(ranks) == 1:  # a node with more ranks than the others: nothing to pair with here
                        continue
                    seconds = timed(operation, args.iters, device)
                record = {"op": op, "scope": scope, "size": size, "bytes": moved, "seconds": seconds}
                records.append({**record, "group_size": len(ranks)})
    return records


# ----------------------------------------------------------------------------- 4. report
def human_bytes(size: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:g} {unit}"
    return f"{size} B"


def human_seconds(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def print_members(members: list[dict], backend: str, nnodes: int, timeout: float) -> None:
    per_node = len(members) // nnodes
    print(f"preflight: {len(members)} ranks on {nnodes} node(s), backend {backend}, every step within {timeout:g} s")
    rows = [("rank", "local", "node", "host", "device", "address")]
    rows += [
        (m["rank"], m["local_rank"], m["node"], m["host"], f"{m['device']} {m['device_name']}", m["address_line"])
        for m in members
    ]
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  " + "  ".join(str(v).ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
    if nnodes * per_node != len(members):
        print("  note: the nodes hold different numbers of ranks")


def print_measurements(measurements: list[dict]) -> None:
    rows = [("op", "scope", "ranks", "size", "time", "algbw GB/s", "busbw GB/s")]
    rows += [
        (
            m["op"],
            m["scope"],
            m["group_size"],
            human_bytes(m["bytes"]),
            human_seconds(m["seconds"]),
            f"{m['algbw_GBps']:.3f}",
            f"{m['busbw_GBps']:.3f}",
        )
        for m in measurements
    ]
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print(
            "  "
            + "  ".join(
                str(v).rjust(w) if i >= 2 else str(v).ljust(w) for i, (v, w) in enumerate(zip(row, widths, strict=True))
            )
        )


def main():
    # ---------------------------------------- flags
    args = build_parser().parse_args()
    check_launch()  # `accelerate launch --cpu --num_processes 2` starts one process: say so
    use_cpu = args.cpu or not torch.cuda.is_available()
    check_args(args, on_gpu=not use_cpu)
    backend = "gloo" if use_cpu else "nccl"
    launch = launch_from_env()
    rank, world_size = launch["rank"], launch["world_size"]
    device, device_name = device_of(launch, use_cpu)
    if device.type == "cuda":
        torch.cuda.set_device(device)

    # ---------------------------------------- 1. join: every rank reaches the rendezvous and checks in
    address, address_from = network_address(backend, launch["master"], rank)
    listener = open_listener(address) if world_size > 1 and address != "?" else None
    # the interface on this host's route to the rendezvous: the one to name when `address` is not reachable
    on_route = route_address(launch["master"][0])
    route_listener = open_listener(on_route) if listener and on_route not in (None, address) else None
    me = {
        "rank": rank,
        "local_rank": launch["local_rank"],
        "node": launch["node"],
        "host": launch["host"],
        "device": str(device),
        "device_name": device_name,
        "address": address,
        "address_from": address_from,
        "port": listener.getsockname()[1] if listener else None,
        "interface": interface_of(address),
        "route_address": on_route,
        "route_interface": interface_of(on_route),
        "route_port": route_listener.getsockname()[1] if route_listener else None,
    }
    store = connect_store(launch, args.timeout) if world_size > 1 else None
    watchdog = Watchdog(store, launch, args.timeout) if world_size > 1 else None
    members = gather_on_store(store, "join", launch, me, args.timeout, NOT_JOINED) if store else [me]
    assign_nodes(members)
    for m in members:
        m["address_line"] = f"{m['address']} ({m['address_from']})"
    if watchdog:
        watchdog.members = members
    me = members[rank]
    nnodes = len({m["node"] for m in members})
    local_world_size = len([m for m in members if m["node"] == me["node"]])
    if rank == 0:
        print_members(members, backend, nnodes, args.timeout)

    # ---------------------------------------- 2. reach: each rank connects to a peer on every other node
    if nnodes > 1:
        problems = probe_peers(me, members, min(args.timeout, 10))
        reports = gather_on_store(store, "reach", launch, problems, args.timeout, "did not report within {timeout} s")
        unreachable = [line for lines in reports for line in lines]
        if unreachable:
            advice = interface_advice(members, unreachable) or (
                "the address comes from GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME (or the host name): set it to the "
                "interface of the network the nodes share, and open the ports between the nodes"
            )
            if rank == 0:
                for line in unreachable[: min(9, len(unreachable) - 1)]:
                    print(f"error: {line}", file=sys.stderr)
            more = f" (and {len(unreachable) - 10} more)" if len(unreachable) > 10 else ""
            fail(f"{unreachable[-1]}{more}: {advice}", show=rank == 0)
    if rank == 0 and world_size > 1:
        peers = " and a peer on every other node" if nnodes > 1 else ""
        print(f"reach: every rank reaches the rendezvous at {launch['master'][0]}:{launch['master'][1]}{peers}")

    # ---------------------------------------- 3. measure: process groups, then each operation in each scope
    measurements: list[dict] = []
    if world_size > 1:
        with watchdog.step(f"process group set-up ({backend})"):
            dist.init_process_group(
                backend,
                store=dist.PrefixStore("process_group", store),
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=args.timeout + 30),  # ours fires first, with the better line
                device_id=device if device.type == "cuda" else None,
            )
        records = measure(build_groups(members), args, rank, device, watchdog)
        per_rank = [None] * world_size
        with watchdog.step("collecting the results (all_gather_object)"):
            dist.all_gather_object(per_rank, records)
        measurements = summarise(per_rank)

    # ---------------------------------------- 4. write
    result = {
        "format": FORMAT,
        "world_size": world_size,
        "nnodes": nnodes,
        "local_world_size": local_world_size,
        "backend": backend,
        "sizes": args.sizes,
        "iters": args.iters,
        "ranks": [
            {k: m[k] for k in ("rank", "local_rank", "node", "host", "device", "device_name", "address")}
            for m in members
        ],
        "links": links_of(measurements),
        "measurements": measurements,
    }
    if rank == 0:
        if measurements:
            print_measurements(measurements)
        else:
            print("measure: one process, nothing to measure between ranks")
        for scope, link in result["links"].items():
            if link:
                bandwidth, latency = link["bandwidth_GBps"], human_seconds(link["latency_us"] / 1e6)
                print(f"link {scope}: {bandwidth:.3f} GB/s all-reduce bus bandwidth, {latency} latency")
        Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.output}")
    if world_size > 1:
        with watchdog.step("the final barrier"):
            dist.barrier()
        watchdog.leave()  # rank 0 may serve the store: it leaves last


if __name__ == "__main__":
    run_main(main)
