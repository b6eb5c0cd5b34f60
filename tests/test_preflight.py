"""scripts/preflight.py: real launches on the CPU (gloo). A healthy job of 2 and 4 processes, and of 2
"nodes" on loopback, writes the JSON that plan_layout.py reads; a missing node, a frozen peer, an
unreachable rendezvous and a wrong interface each end the check with one `error:` line within the
timeout. Sizes and repetitions are tiny: the point is the plumbing, not the figures."""

import json
import socket
import subprocess
import sys
import time

import psutil
import pytest

from conftest import REPO, accelerate_launch_cmd, free_port, job_env, kill_tree, launch

QUICK = ["--sizes", "4K,64K", "--iters", "2"]
OPS = {"all_reduce", "all_gather", "send_recv"}


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def check_report(path, world_size: int, nnodes: int) -> dict:
    """The JSON contract plan_layout.py relies on, and figures that are measurements, not placeholders."""
    report = json.loads(path.read_text())
    assert report["format"] == "preflight/1" and report["backend"] == "gloo"
    assert (report["world_size"], report["nnodes"]) == (world_size, nnodes)
    assert report["local_world_size"] == world_size // nnodes
    assert [r["rank"] for r in report["ranks"]] == list(range(world_size))
    per_node = world_size // nnodes
    assert [(r["node"], r["local_rank"]) for r in report["ranks"]] == [divmod(r, per_node) for r in range(world_size)]
    assert all(r["host"] and r["device"] == "cpu" for r in report["ranks"])
    rows = report["measurements"]
    for row in rows:
        assert row["seconds"] > 0 and row["algbw_GBps"] > 0, row
        assert row["algbw_GBps"] == pytest.approx(row["bytes"] / row["seconds"] / 1e9)
        n = row["group_size"]
        factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "send_recv": 1}[row["op"]]
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * factor), row
    for scope, link in report["links"].items():
        all_reduce = sorted(
            (r for r in rows if r["op"] == "all_reduce" and r["scope"] == scope), key=lambda r: r["bytes"]
        )
        if link is None:
            assert not all_reduce, f"{scope} was measured but its link is null"
            continue
        assert link["bandwidth_GBps"] == all_reduce[-1]["busbw_GBps"] and all_reduce[-1]["bytes"] == 64 * 1024
        assert link["latency_us"] == pytest.approx(all_reduce[0]["seconds"] * 1e6)
        ring = max((r for r in rows if r["op"] == "send_recv" and r["scope"] == scope), key=lambda r: r["bytes"])
        assert link["ring_p2p_GBps"] == ring["busbw_GBps"] > 0  # context parallelism's ring (plan_layout.py reads it)
    return report


def scopes_of(report: dict) -> dict[str, set]:
    """scope -> the (op, bytes) measured in it."""
    scopes: dict[str, set] = {}
    for row in report["measurements"]:
        scopes.setdefault(row["scope"], set()).add((row["op"], row["bytes"]))
    return scopes


@pytest.mark.parametrize("nproc", [2, 4])
def test_one_node(nproc, tmp_path):
    out = tmp_path / "preflight.json"
    result = launch("preflight.py", [*QUICK, "--output", str(out), "--timeout", "60"], nproc=nproc)
    report = check_report(out, world_size=nproc, nnodes=1)
    assert scopes_of(report) == {"intra_node": {(op, size) for op in OPS for size in (4096, 65536)}}
    assert report["links"]["inter_node"] is None and report["links"]["intra_node"]["bandwidth_GBps"] > 0
    assert {r["group_size"] for r in report["measurements"]} == {nproc}
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"preflight: {nproc} ranks on 1 node(s)")
    table = [line.split()[:3] for line in lines[2 : 2 + nproc]]  # rank, local rank, node
    assert table == [[str(r), str(r), "0"] for r in range(nproc)], result.stdout
    assert f"wrote {out}" in lines[-1] and not error_lines(result.stderr)


def test_two_nodes_on_loopback(tmp_path):
    """Two `accelerate launch --num_machines 2` on one host, 2 processes each: two nodes, so all three scopes."""
    out, port, procs = tmp_path / "preflight.json", free_port(), []
    args = [*QUICK, "--output", str(out), "--timeout", "60"]
    for node in (0, 1):
        flags = ["--multi_gpu", "--num_machines", "2", "--num_processes", "4", "--machine_rank", str(node)]
        flags += ["--main_process_ip", "127.0.0.1", "--main_process_port", str(port), "--rdzv_backend", "static"]
        cmd = accelerate_launch_cmd(flags, "preflight.py", args)
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=REPO,
                env=job_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )
    try:
        logs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            kill_tree(p.pid)
    assert all(p.returncode == 0 for p in procs), "\n".join(out + err[-3000:] for out, err in logs)
    report = check_report(out, world_size=4, nnodes=2)
    assert set(scopes_of(report)) == {"intra_node", "inter_node", "world"}
    assert report["links"]["intra_node"] and report["links"]["inter_node"]
    assert {(r["scope"], r["group_size"]) for r in report["measurements"]} == {
        ("intra_node", 2),
        ("inter_node", 2),
        ("world", 4),
    }
    assert "and a peer on every other node" in logs[0][0]


# ----------------------------------------------------------------------------- failures
def start_ranks(ranks: list[int], world_size: int, per_node: int, port: int, args: list[str], **env) -> list:
    """One plain `python scripts/preflight.py` per rank, the way srun or mpirun start ranks: RANK,
    WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK and MASTER_ADDR/PORT, no launcher in between."""
    procs = []
    for rank in ranks:
        rank_env = job_env(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank % per_node),
            LOCAL_WORLD_SIZE=str(per_node),
            NODE_RANK=str(rank // per_node),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            **env,
        )
        cmd = [sys.executable, "scripts/preflight.py", *args]
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=REPO,
                env=rank_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )
    return procs


def finish(procs: list, timeout: float = 120) -> list[tuple[str, str]]:
    try:
        return [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            kill_tree(p.pid)


def test_missing_node_is_named_within_the_timeout(tmp_path):
    """Node 0 of 2 (ranks 0 and 1 of 4) starts; node 1 never does. Rank 0 says which ranks are missing
    after --timeout 3 s, in one line, and both ranks exit non-zero; nothing is written."""
    out = tmp_path / "preflight.json"
    start = time.monotonic()
    procs = start_ranks([0, 1], 4, 2, free_port(), [*QUICK, "--output", str(out), "--timeout", "3"])
    logs = finish(procs)
    took = time.monotonic() - start
    assert [p.returncode for p in procs] == [1, 1], logs
    assert error_lines(logs[0][1]) == [
        "error: ranks 2, 3 (node 1) did not join within 3 s: check that every node was started with the same "
        "command (only the node rank differs), that each reaches MASTER_ADDR:MASTER_PORT, and the lines the "
        "missing ranks printed"
    ]
    assert not error_lines(logs[1][1]), "rank 0 alone reports it"
    assert took < 60, f"took {took:.0f} s with --timeout 3 (start-up included)"
    assert not out.exists()


def test_frozen_peer_is_named_within_the_timeout(tmp_path):
    """Rank 1 of 2 freezes (SIGSTOP: its connections stay open, nothing answers) as soon as the two have
    joined. Rank 0 must fail within --timeout 3 s with one line naming rank 1 and the step it was in."""
    procs = start_ranks([0, 1], 2, 2, free_port(), ["--sizes", "4K,64K,1M", "--iters", "20", "--timeout", "3"])
    try:
        for line in procs[0].stdout:  # rank 0 prints "reach: ..." once both have joined
            if line.startswith("reach:"):
                break
        psutil.Process(procs[1].pid).suspend()
        frozen_at = time.monotonic()
        _, err = procs[0].communicate(timeout=60)
        took = time.monotonic() - frozen_at
    finally:
        for p in procs:
            kill_tree(p.pid)
    assert procs[0].returncode == 1, err
    lines = error_lines(err)
    assert len(lines) == 1 and "did not finish within 3 s: rank 1 (host " in lines[0], err
    assert "stopped answering: dead or frozen" in lines[0]
    assert 3 <= took < 25, f"rank 0 gave up after {took:.0f} s, not after the 3 s timeout"


PROBE_CLOSED_PORT = """
import sys
sys.path.insert(0, "scripts")
from preflight import probe_peers
me = {"rank": 2, "local_rank": 0, "node": 1, "host": "b"}
peer = {"rank": 0, "local_rank": 0, "node": 0, "host": "a", "address": "127.0.0.1", "port": int(sys.argv[1]),
        "address_from": "host name"}
print("\\n".join(probe_peers(me, [peer, me], timeout=3)))
"""


def test_bad_set_up_is_named_at_once():
    """Four processes side by side: rank 1 of 2 alone, nothing listening at MASTER_PORT (it names
    itself and the address after --timeout 3 s); GLOO_SOCKET_IFNAME naming no interface; a bad flag;
    and the reach test against a peer's port where nothing listens (the line it gives)."""
    # The port stays bound, never listening, for the whole test: connections to it are refused, and
    # no other job's store or gloo pair (they take ports from the same ephemeral range) can take it.
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    start = time.monotonic()
    unreachable = start_ranks([1], 2, 1, port, ["--timeout", "3"])
    wrong_interface = start_ranks([1], 2, 1, port, ["--timeout", "3"], GLOO_SOCKET_IFNAME="nonexistent0")
    bad_flag = start_ranks([0], 1, 1, port, ["--sizes", "4K,4X"])
    probe = [
        subprocess.Popen(
            [sys.executable, "-c", PROBE_CLOSED_PORT, str(port)],
            cwd=REPO,
            env=job_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    ]
    try:
        logs = finish(unreachable + wrong_interface + bad_flag + probe)
    finally:
        closed.close()
    took = time.monotonic() - start
    codes = [p.returncode for p in unreachable + wrong_interface + bad_flag + probe]
    assert codes == [1, 1, 2, 0], logs
    errors = [error_lines(err) for _, err in logs]
    assert len(errors[0]) == 1, logs[0]
    assert errors[0][0].startswith(
        f"error: rank 1 (host {socket.gethostname()}) cannot reach the rendezvous at 127.0.0.1:{port} ("
    )
    assert len(errors[1]) == 1 and "GLOO_SOCKET_IFNAME=nonexistent0 names no interface" in errors[1][0], logs[1]
    assert logs[2][1].strip().splitlines() == [
        "error: --sizes: '4X' is not a size: give bytes like 4096, 4K, 16M or 1G"
    ]
    assert logs[3][0].strip().splitlines() == [
        f"rank 2 (host b, node 1) cannot reach rank 0 (host a, node 0) at 127.0.0.1:{port} "
        "(Connection refused; address from host name, a loopback address other hosts cannot reach)"
    ], logs[3]
    assert took < 90  # without deadlines the store client alone would wait 300 s
