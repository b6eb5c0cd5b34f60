#!/usr/bin/env python
"""N machines on this one: each "node" is a Linux network namespace with its own network stack,
interface and address, joined to the others by a veth link to a bridge; a training script runs on
every node under torchrun's multi-node rendezvous, exactly as on real hosts.

    root namespace                  node 0 (namespace)             node 1 (namespace)
    bridge <prefix>br ── veth ──── eth0 10.77.0.1/24   ...   ──── eth0 10.77.0.2/24
                          (tbf --rate on both ends of each link, if given)

    sudo .venv/bin/python slurm/local_nodes.py --nodes 2 --nproc_per_node 2 [--rate 20mbit] \\
        scripts/train_ddp.py --model_size tiny --max_steps 20 --output_dir runs/ddp-2n

On node i it runs, inside that namespace, what one would type on host i:
    GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 torchrun --nnodes N --node_rank i --nproc_per_node P \\
        --master_addr 10.77.0.1 --master_port 29500 SCRIPT FLAGS...
With --decoy_interface every node also has eth1 (10.78.0.i), a network no other node is on, and its host
name resolves there: with --socket_ifname none (no GLOO_SOCKET_IFNAME) gloo listens on eth1 and the nodes
cannot connect, the trouble of a real host with a Docker bridge or a second network card.
With --elastic the rendezvous is torchrun's elastic one (--nnodes 1:N, c10d on node 0): a node lost for good
(its link down, its processes killed) leaves the others to restart without it, and a node started again joins
at their next restart; each node's command is printed, to start it again by hand.
Every namespace has its own ports, so two runs never collide; names carry this process's id
(`ln<pid><letter>`), so two runs' interfaces do not either. Everything is torn down at the end, on
Ctrl-C, SIGTERM and on failure (`--cleanup` removes what a killed run left). The bytes each node's
interface sent and received (its counters, read inside the namespace before and after) are printed
and, with `--counters FILE`, written as JSON. Needs root (CAP_NET_ADMIN): without it, or where
namespaces cannot be made, it says so in one line and exits 2.
"""

from __future__ import annotations

import argparse
import ipaddress
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

IFNAME = "eth0"  # each node's interface, as on a real host (each namespace has its own names)
DECOY_IFNAME = "eth1"  # --decoy_interface: a second interface, on a network no other node is on
MASTER_PORT = 29500  # node 0's rendezvous port: free in a fresh namespace
ETC_NETNS = Path("/etc/netns")
NAME = re.compile(r"^ln(\d+)[a-z]")  # ln<pid><letter>: the prefix of one run's namespaces and links
_letters = itertools.count()


class NetnsUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no `ip`, no netns or veth support)."""


def _ip(*args: str) -> subprocess.CompletedProcess:
    return _quiet(["ip", *args])


def _quiet(cmd: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError:
        return subprocess.CompletedProcess(cmd, 127, "", f"{cmd[0]}: command not found (install iproute2)")


def _must(*args: str) -> None:
    result = _ip(*args)
    if result.returncode != 0:
        raise NetnsUnavailable(f"`ip {' '.join(args)}` failed: {result.stderr.strip() or result.returncode}")


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be made here, or None when they can (tried for real)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN): run as root (CI does), e.g. sudo .venv/bin/python ..."
    try:
        with LocalNodes(1):
            pass
    except NetnsUnavailable as error:
        return str(error)
    return None


@dataclass
class NodeResult:
    """One node's launcher: exit code, output, and its interface's counters over the run."""

    rank: int
    returncode: int
    stdout: str
    stderr: str
    tx_bytes: int
    rx_bytes: int
    tx_packets: int
    rx_packets: int


@dataclass
class RunResult:
    nodes: list[NodeResult] = field(default_factory=list)
    seconds: float = 0.0
    timed_out: bool = False

    @property
    def returncode(self) -> int:
        return next((n.returncode for n in self.nodes if n.returncode != 0), 0)

    def as_dict(self) -> dict:
        return {
            "seconds": round(self.seconds, 2),
            "timed_out": self.timed_out,
            "nodes": [{k: v for k, v in vars(n).items() if k not in ("stdout", "stderr")} for n in self.nodes],
        }


class LocalNodes:
    """`with LocalNodes(2, rate="20mbit") as nodes: nodes.run("scripts/train_ddp.py", [...], 2)`:
    the namespaces exist inside the block and are removed when it ends, whatever ends it."""

    def __init__(
        self,
        n_nodes: int,
        rate: str | None = None,
        subnet: str = "10.77.0.0/24",
        decoy: bool = False,
        decoy_subnet: str = "10.78.0.0/24",
    ):
        if n_nodes < 1:
            raise ValueError("at least one node")
        self.n_nodes, self.rate, self.decoy = n_nodes, rate, decoy
        self.prefix = f"ln{os.getpid()}{chr(ord('a') + next(_letters) % 26)}"
        hosts = ipaddress.ip_network(subnet).hosts()
        self.addresses = [str(next(hosts)) for _ in range(n_nodes)]
        decoys = ipaddress.ip_network(decoy_subnet).hosts()
        self.decoy_addresses = [str(next(decoys)) for _ in range(n_nodes)] if decoy else []
        self.prefixlen = ipaddress.ip_network(subnet).prefixlen
        self.bridge = f"{self.prefix}br"
        self.namespaces = [f"{self.prefix}-n{i}" for i in range(n_nodes)]
        self._up = False

    # ------------------------------------------------------------------ bring up, tear down
    def __enter__(self) -> LocalNodes:
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root (CAP_NET_ADMIN)")
        self._up = True
        try:
            _must("link", "add", self.bridge, "type", "bridge")
            _must("link", "set", self.bridge, "up")
            for i, ns in enumerate(self.namespaces):
                host_end, node_end = f"{self.prefix}h{i}", f"{self.prefix}n{i}"
                _must("netns", "add", ns)
                self._write_etc(ns)
                _must("link", "add", host_end, "type", "veth", "peer", "name", node_end)
                _must("link", "set", host_end, "master", self.bridge)
                _must("link", "set", host_end, "up")
                _must("link", "set", node_end, "netns", ns)
                _must("-n", ns, "link", "set", node_end, "name", IFNAME)
                _must("-n", ns, "addr", "add", f"{self.addresses[i]}/{self.prefixlen}", "dev", IFNAME)
                _must("-n", ns, "link", "set", IFNAME, "up")
                _must("-n", ns, "link", "set", "lo", "up")  # the node's own ranks talk over its loopback
                if self.decoy:
                    self._add_decoy(i, ns)
                if self.rate:  # both directions of the link: what leaves the node, what enters it
                    tbf = ["root", "tbf", "rate", self.rate, "burst", "64kb", "latency", "400ms"]
                    _run_checked(["tc", "qdisc", "add", "dev", host_end, *tbf])
                    _run_checked(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", IFNAME, *tbf])
        except BaseException:
            self.close()
            raise
        return self

    def _add_decoy(self, i: int, ns: str) -> None:
        """A second interface, eth1, on a network of its own: a veth whose other end stays in the root
        namespace, up but on no bridge. Like a Docker bridge, a VPN or a management network on a real
        host, it reaches no other node: a packet to another node's eth1 address leaves eth1 and nobody
        answers. The node's host name resolves to it (_write_etc), so gloo, which binds to the address
        of the host name unless GLOO_SOCKET_IFNAME says otherwise, listens there."""
        host_end, node_end = f"{self.prefix}d{i}", f"{self.prefix}e{i}"
        _must("link", "add", host_end, "type", "veth", "peer", "name", node_end)
        _must("link", "set", host_end, "up")
        _must("link", "set", node_end, "netns", ns)
        _must("-n", ns, "link", "set", node_end, "name", DECOY_IFNAME)
        _must("-n", ns, "addr", "add", f"{self.decoy_addresses[i]}/24", "dev", DECOY_IFNAME)
        _must("-n", ns, "link", "set", DECOY_IFNAME, "up")

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Kill what still runs in the namespaces, delete them (which deletes their veth ends and so
        the host ends) and the bridge. Safe to call twice."""
        if not self._up:
            return
        self._up = False
        for ns in self.namespaces:
            kill_namespace_processes(ns)
            _ip("netns", "del", ns)
        for i in range(self.n_nodes):
            _ip("link", "del", f"{self.prefix}h{i}")  # already gone unless the namespace was never made
            if self.decoy:
                _ip("link", "del", f"{self.prefix}d{i}")
        _ip("link", "del", self.bridge)
        for ns in self.namespaces:
            _remove_etc(ns)

    def _write_etc(self, ns: str) -> None:
        """`ip netns exec` mounts /etc/netns/<ns>/* over /etc/*: give every node the others' names, as
        /etc/hosts does on a cluster, and no name server (the host's is unreachable from the namespace:
        c10d's reverse look-ups of peer addresses would each wait for its timeout, seconds per rank)."""
        etc = ETC_NETNS / ns
        etc.mkdir(parents=True, exist_ok=True)
        names = "".join(f"{a} {self.prefix}-node{i}\n" for i, a in enumerate(self.addresses))
        # the namespaces share this host's name: there, it is the node's own address (its eth1's
        # with --decoy_interface, where gloo's own choice then cannot reach the other nodes)
        i = self.namespaces.index(ns)
        own = self.decoy_addresses[i] if self.decoy else self.addresses[i]
        (etc / "hosts").write_text(f"127.0.0.1 localhost\n{own} {socket.gethostname()}\n{names}")
        (etc / "resolv.conf").write_text("# local_nodes.py: no name server inside the namespaces\n")

    # ------------------------------------------------------------------ counters and runs
    def counters(self, rank: int) -> dict[str, int]:
        """The node's interface counters, read inside its namespace (sysfs is that namespace's there)."""
        names = ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")
        paths = [f"/sys/class/net/{IFNAME}/statistics/{n}" for n in names]
        out = subprocess.run(
            ["ip", "netns", "exec", self.namespaces[rank], "cat", *paths], capture_output=True, text=True, check=True
        ).stdout.split()
        return dict(zip(names, map(int, out), strict=True))

    def node_command(
        self,
        rank: int,
        script: str,
        args: list[str],
        nproc_per_node: int,
        launcher_args: list[str] = (),
        elastic: bool = False,
    ) -> list[str]:
        """What one would type on host `rank`, run inside its namespace (`launcher_args` go to torchrun).
        `elastic`: torchrun's elastic rendezvous, `--nnodes 1:N` on node 0's c10d store, so that the job
        goes on with the nodes that are left and takes a node back at its next restart."""
        if elastic:
            rendezvous = [
                "--nnodes",
                f"1:{self.n_nodes}",
                "--rdzv_backend",
                "c10d",
                "--rdzv_endpoint",
                f"{self.addresses[0]}:{MASTER_PORT}",
                "--rdzv_id",
                "local_nodes",
                "--local_addr",  # the address the others reach this node at (all nodes share one host name)
                self.addresses[rank],
                "--rdzv_conf",  # node 0 holds the store; a round with fewer nodes than N waits 5 s for more
                f"is_host={int(rank == 0)},last_call_timeout=5",
            ]
        else:
            rendezvous = ["--nnodes", str(self.n_nodes), "--node_rank", str(rank)]
            rendezvous += ["--master_addr", self.addresses[0], "--master_port", str(MASTER_PORT)]
        return [
            "ip",
            "netns",
            "exec",
            self.namespaces[rank],
            sys.executable,
            "-m",
            "torch.distributed.run",
            *rendezvous,
            "--nproc_per_node",
            str(nproc_per_node),
            *launcher_args,
            script,
            *args,
        ]

    def node_env(self, env: dict | None = None, socket_ifname: str | None = IFNAME, elastic: bool = False) -> dict:
        """The environment of every node's launcher. `elastic`: each round of the rendezvous gives the workers
        a new store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): with torchrun's one shared store, the round that takes
        a returning node back failed after 60 s (DistStoreError ... MASTER_ADDR, torch 2.13)."""
        env = dict(os.environ if env is None else env)
        env.update(OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
        if socket_ifname:
            env.update(GLOO_SOCKET_IFNAME=socket_ifname)
        else:
            env.pop("GLOO_SOCKET_IFNAME", None)
        if elastic:
            env.update(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        env.pop("MASTER_ADDR", None), env.pop("MASTER_PORT", None)
        return env

    def start(self, rank: int, command: list[str], env: dict, cwd=None, stdout=subprocess.PIPE, stderr=None):
        """Start node `rank`'s launcher (a `node_command`); its own session, so Ctrl-C reaches this process only."""
        return subprocess.Popen(
            command,
            cwd=cwd,
            env=env,
            stdout=stdout,
            stderr=stdout if stderr is None else stderr,
            text=True,
            start_new_session=True,  # Ctrl-C reaches this process only; close() ends the nodes
        )

    def lose_node(self, rank: int) -> None:
        """Node `rank` lost for good, as a machine that dies: its link goes down (no packet of its end reaches
        the others, so they see silence, not a closed connection), then every process on it is killed."""
        _must("link", "set", f"{self.prefix}h{rank}", "down")
        kill_namespace_processes(self.namespaces[rank])

    def restore_node(self, rank: int) -> None:
        """Its link up again (the machine is back, with nothing running on it)."""
        _must("link", "set", f"{self.prefix}h{rank}", "up")

    def run(
        self,
        script: str,
        args: list[str],
        nproc_per_node: int = 1,
        timeout: float = 600,
        env: dict | None = None,
        cwd: str | Path | None = None,
        stream: bool = False,
        socket_ifname: str | None = IFNAME,
        launcher_args: list[str] = (),
        elastic: bool = False,
    ) -> RunResult:
        """Run `script args` on every node at once; wait for all (or kill all at `timeout`).
        `socket_ifname=None` sets no GLOO_SOCKET_IFNAME: gloo then picks the interface itself."""
        env = self.node_env(env, socket_ifname, elastic)
        before = [self.counters(r) for r in range(self.n_nodes)]
        out = None if stream else subprocess.PIPE
        start, result = time.monotonic(), RunResult()
        procs = [
            self.start(
                r, self.node_command(r, script, args, nproc_per_node, list(launcher_args), elastic), env, cwd, out
            )
            for r in range(self.n_nodes)
        ]
        outputs: list = [("", "")] * len(procs)
        threads = [
            threading.Thread(target=lambda i=i: outputs.__setitem__(i, procs[i].communicate()), daemon=True)
            for i in range(len(procs))
        ]  # one reader per node: waiting on one node's pipes while another's fill up would block it
        try:
            for t in threads:
                t.start()
            # short joins: a signal (Ctrl-C) is handled between two of them, never inside a long one
            while time.monotonic() < start + timeout:
                alive = [t for t in threads if t.is_alive()]
                if not alive:
                    break
                alive[0].join(0.2)
            if any(t.is_alive() for t in threads):
                result.timed_out = True
                for ns in self.namespaces:
                    kill_namespace_processes(ns)
                for t in threads:
                    t.join(30)  # their processes are gone: the pipes close
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        result.seconds = time.monotonic() - start
        for r, (p, (stdout, stderr)) in enumerate(zip(procs, outputs, strict=True)):
            after = self.counters(r)
            delta = {k: after[k] - before[r][k] for k in after}
            result.nodes.append(NodeResult(r, p.returncode, stdout or "", stderr or "", **delta))
        return result


def _run_checked(cmd: list[str]) -> None:
    result = _quiet(cmd)
    if result.returncode != 0:
        raise NetnsUnavailable(f"`{' '.join(cmd)}` failed: {result.stderr.strip() or result.returncode}")


def _remove_etc(ns: str) -> None:
    etc = ETC_NETNS / ns
    for name in ("hosts", "resolv.conf"):
        (etc / name).unlink(missing_ok=True)
    try:
        etc.rmdir()
    except OSError:
        pass


def kill_namespace_processes(ns: str) -> None:
    """SIGKILL every process running inside namespace `ns` (ours: the namespace is this run's)."""
    pids = _ip("netns", "pids", ns).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def cleanup_stale() -> list[str]:
    """Remove the namespaces and links of runs whose process is gone (a run killed with SIGKILL)."""
    removed = []

    def stale(name: str) -> bool:
        match = NAME.match(name)
        if not match:
            return False
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    for ns in _ip("netns", "list").stdout.split("\n"):
        ns = ns.split(" ")[0]
        if ns and stale(ns):
            kill_namespace_processes(ns)
            _ip("netns", "del", ns)
            removed.append(ns)
    for etc in ETC_NETNS.glob("ln*") if ETC_NETNS.is_dir() else []:
        if stale(etc.name):
            _remove_etc(etc.name)
    for line in _ip("-o", "link", "show").stdout.splitlines():
        parts = line.split(": ")
        name = parts[1].split("@")[0] if len(parts) > 1 else ""
        if stale(name):
            _ip("link", "del", name)
            removed.append(name)
    return removed


def refusal(args) -> str | None:
    """What is wrong with the command, checked before any namespace is made (else torchrun on every node fails
    with its own traceback, and this script exits != 0 without a line), or None."""
    if not args.script:
        return "the training script is missing: give it after the flags, e.g. scripts/train_ddp.py"
    if not Path(args.script).is_file():
        return f"{args.script}: no such training script (give its path, e.g. scripts/train_ddp.py)"
    if args.nodes < 1 or args.nproc_per_node < 1:
        return f"--nodes {args.nodes} --nproc_per_node {args.nproc_per_node}: each must be at least 1"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=2, help="how many machines (namespaces) (default: 2)")
    parser.add_argument("--nproc_per_node", type=int, default=1, help="processes per machine (default: 1)")
    parser.add_argument("--rate", help="limit every link to this rate, both ways (tc tbf): e.g. 20mbit, 1gbit")
    parser.add_argument("--timeout", type=float, default=3600, help="kill every node after this many seconds")
    parser.add_argument("--counters", help="write each node's interface counters over the run to this JSON file")
    parser.add_argument("--cleanup", action="store_true", help="remove what killed runs left behind, then exit")
    parser.add_argument(
        "--decoy_interface",
        action="store_true",
        help=f"give every node a second interface, {DECOY_IFNAME} (10.78.0.i), on a network no other node is on, and "
        "make the node's host name resolve to it, as a Docker bridge or a second card can on a real host: gloo, "
        f"without GLOO_SOCKET_IFNAME, listens there and the nodes cannot connect (with --socket_ifname none)",
    )
    parser.add_argument(
        "--socket_ifname",
        default=IFNAME,
        help=f"the GLOO_SOCKET_IFNAME each node gets (default: {IFNAME}); 'none' sets none, so gloo picks the "
        "interface itself, from the host name",
    )
    parser.add_argument(
        "--max_restarts",
        type=int,
        default=0,
        help="torchrun's --max_restarts on every node: restart the workers after a failure, with "
        "--resume_from_checkpoint auto (default: 0)",
    )
    parser.add_argument(
        "--elastic",
        action="store_true",
        help="torchrun's elastic rendezvous (--nnodes 1:N, c10d on node 0's address): when a node is lost the "
        "others restart without it (with --max_restarts and --resume_from_checkpoint auto), and a node started again "
        "joins at the next restart; each node's command is printed, to start a lost node again by hand",
    )
    parser.add_argument("script", nargs="?", help="the training script, e.g. scripts/train_ddp.py")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="its flags")
    args = parser.parse_args(argv)
    name = "local_nodes.py"
    refused = None if args.cleanup else refusal(args)
    if refused:
        print(f"error: {name}: {refused}", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print(f"error: {name}: network namespaces need root (CAP_NET_ADMIN); run it as root", file=sys.stderr)
        return 2
    if args.cleanup:
        removed = cleanup_stale()
        print(f"{name}: removed {len(removed)}: {' '.join(removed) or 'nothing left behind'}")
        return 0

    def stop(signum, _frame):  # each as Ctrl-C: unwind through close()
        raise KeyboardInterrupt

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGINT too: a background job inherits it ignored
        signal.signal(signum, stop)
    try:
        with LocalNodes(args.nodes, rate=args.rate, decoy=args.decoy_interface) as nodes:
            decoy = (
                f", host names on {DECOY_IFNAME} ({', '.join(nodes.decoy_addresses)})" if args.decoy_interface else ""
            )
            socket_ifname = None if args.socket_ifname.lower() == "none" else args.socket_ifname
            print(
                f"{name}: {args.nodes} nodes x {args.nproc_per_node} processes, "
                f"{', '.join(f'{ns} {a}' for ns, a in zip(nodes.namespaces, nodes.addresses, strict=True))} "
                f"({IFNAME} each{decoy}), links {args.rate or 'unthrottled'}; rendezvous "
                f"{nodes.addresses[0]}:{MASTER_PORT}; GLOO_SOCKET_IFNAME={socket_ifname or '(not set)'}",
                flush=True,
            )
            restarts = ["--max_restarts", str(args.max_restarts)] if args.max_restarts else []
            if args.elastic:  # what to type to start a lost node again (it joins at the next restart)
                env = nodes.node_env(None, socket_ifname, elastic=True)
                for rank in range(args.nodes):
                    command = nodes.node_command(
                        rank, args.script, args.script_args, args.nproc_per_node, restarts, True
                    )
                    settings = " ".join(
                        f"{k}={env[k]}"
                        for k in ("GLOO_SOCKET_IFNAME", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
                        if k in env
                    )
                    print(f"{name}: node {rank}: {settings} {' '.join(command)}", flush=True)
            result = nodes.run(
                args.script,
                args.script_args,
                args.nproc_per_node,
                args.timeout,
                stream=True,
                socket_ifname=socket_ifname,
                launcher_args=restarts,
                elastic=args.elastic,
            )
    except NetnsUnavailable as error:
        print(f"error: {name}: cannot make network namespaces here: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{name}: interrupted; namespaces removed", file=sys.stderr)
        return 130
    for n in result.nodes:
        print(
            f"{name}: node {n.rank}: exit {n.returncode}, {IFNAME} sent {n.tx_bytes} B in {n.tx_packets} packets, "
            f"received {n.rx_bytes} B in {n.rx_packets}"
        )
    if result.timed_out:
        print(f"error: {name}: killed after --timeout {args.timeout:g} s", file=sys.stderr)
    if args.counters:
        Path(args.counters).write_text(json.dumps(result.as_dict(), indent=1) + "\n")
    return 124 if result.timed_out else result.returncode


if __name__ == "__main__":
    sys.exit(main())
