"""Several machines on one host (slurm/local_nodes.py): 2 network namespaces on a bridge, each with its own
interface (eth0) and address, and torchrun's multi-node rendezvous on node 0's address, as on real hosts.

- parity: train_ddp.py, train_fsdp.py and HSDP (--dp_replicate 2: shard inside a node, replicate across)
  on 2 nodes x 2 processes, and train_pp.py with one stage per node, give the single-process run's losses
  (within 1e-5, fp32); DiLoCo on 2 nodes gives its own 1-node run's;
- bytes on the wire: each node's eth0 counters (read inside its namespace) against the run's own
  accounting, once the measured TCP/IP headers (66 B a packet) are taken off: within 5%. For HSDP only the
  replicate all-reduce crosses the link; the shard collectives stay on each node's loopback;
- two interfaces (--decoy_interface): the host name resolves to eth1, which reaches no other node, and no
  GLOO_SOCKET_IFNAME is set: preflight.py names eth0 and the GLOO_SOCKET_IFNAME to set, and train_ddp.py
  fails within --collective_timeout with one `error:` line on each node naming it;
- a link down for 20 s mid-run under torchrun --max_restarts 3 with --resume_from_checkpoint auto: the run
  restarts by itself and ends with the uninterrupted run's losses, exactly.

All runs share one pair of namespaces (a module fixture), removed at the end with every process in them.
Needs root (CAP_NET_ADMIN): elsewhere the tests skip with the reason; as root (our CI runs as root) or
with the CI environment variable set, a missing namespace fails instead, so that they cannot vanish quietly.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from conftest import (
    REPO,
    TINY,
    assert_layout,
    assert_matches_reference,
    assert_same_evals,
    assert_same_losses,
    job_env,
    launch,
    read_metrics,
    summary,
    train_losses,
)

sys.path.insert(0, str(REPO / "slurm"))
import local_nodes

# one xdist worker runs these tests: they share the namespaces and the runs made in them
pytestmark = pytest.mark.xdist_group("multinode")

# the single-process reference of tests/test_pp.py (the same flags: one session builds it once)
FLAGS = ["--n_layer", "4", "--max_steps", "20", "--eval_batch_size", "64"]
STEPS = list(range(1, 21))
# 2 nodes: (script, processes per node, flags); global batch 16 everywhere
# the link's bytes are the 20 steps' alone: the start-up cut check (its probe step, the gradients gathered to be
# compared) is tested elsewhere, and off where the test weighs what crosses the link
LINK_ONLY = ["--skip_cut_check"]
CASES = {
    "ddp": ("train_ddp.py", 2, [*FLAGS, "--batch_size", "4", *LINK_ONLY]),
    "fsdp": ("train_fsdp.py", 2, [*FLAGS, "--batch_size", "4"]),
    "hsdp": ("train_fsdp.py", 2, [*FLAGS, "--batch_size", "4", "--dp_replicate", "2", *LINK_ONLY]),
    "pp": ("train_pp.py", 1, [*FLAGS, "--batch_size", "16", "--pp_size", "2"]),
    # DiLoCo, one replica per node, fused every 4 steps: against its own run on one node (2 processes)
    "diloco": (
        "train_localsgd.py",
        1,
        [*FLAGS, "--batch_size", "8", "--outer_optimizer", "nesterov", "--sync_every", "4"],
    ),
}
HEADER_BYTES = 66  # what each packet adds on the link: Ethernet 14 + IPv4 20 + TCP 20 with 12 of timestamps
LAUNCH_TIMEOUT = 300


@functools.lru_cache(maxsize=None)
def netns_reason() -> str | None:
    """Why namespaces cannot be made here (tried once), or None."""
    try:
        return local_nodes.unavailable_reason()
    except Exception as error:  # anything that stops a namespace from being made is a reason to skip
        return f"{type(error).__name__}: {error}"


def test_ci_makes_the_namespaces():
    """The multi-node tests skip where namespaces cannot be made without root; as root (our CI runs as root)
    or with CI set, that is a failure: the tests cannot vanish quietly."""
    reason = netns_reason()
    if reason and (os.environ.get("CI") or os.geteuid() == 0):
        pytest.fail(f"running as root (or CI is set), but the multi-node tests cannot run: {reason}")
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def nodes():
    reason = netns_reason()
    if reason:
        pytest.skip(reason)
    with local_nodes.LocalNodes(2) as made:
        yield made
    assert not [ns for ns in made.namespaces if ns in local_nodes._ip("netns", "list").stdout], "namespaces left"


@pytest.fixture(scope="module")
def two_nodes(nodes, tmp_path_factory, data_cache):
    """two_nodes(case) -> (output directory, RunResult): the case run once on the 2 nodes."""
    cache: dict = {}

    def run(name: str):
        if name not in cache:
            script, nproc, flags = CASES[name]
            out = tmp_path_factory.mktemp("multinode") / name
            args = [*TINY, *flags, "--data_cache_dir", data_cache, "--output_dir", str(out)]
            result = nodes.run(f"scripts/{script}", args, nproc, timeout=LAUNCH_TIMEOUT, env=job_env(), cwd=REPO)
            assert not result.timed_out, f"{name}: killed after {LAUNCH_TIMEOUT}s"
            for node in result.nodes:
                assert node.returncode == 0, f"{name}, node {node.rank}: exit {node.returncode}\n{node.stderr[-4000:]}"
            cache[name] = out, result
        return cache[name]

    return run


@pytest.mark.parametrize("name", ["ddp", "fsdp", "hsdp", "pp"])
def test_two_nodes_match_one_process(name, two_nodes, reference):
    """The same losses (1e-5) and final evaluation as one process, whatever crosses the link."""
    out, _ = two_nodes(name)
    degrees = {"pp": {"pp": 2, "dp_shard": 1}, "hsdp": {"dp_replicate": 2, "dp_shard": 2}, "fsdp": {"dp_shard": 4}}
    if name in degrees:
        assert_layout(out, **degrees[name])
    assert summary(out)["world_size"] == (2 if name == "pp" else 4)
    assert_matches_reference(reference(*FLAGS, "--batch_size", "16"), out, STEPS)


def test_diloco_on_two_nodes_matches_its_run_on_one(two_nodes, shared_run):
    out, _ = two_nodes("diloco")
    script, _, flags = CASES["diloco"]
    one_node = shared_run(script, 2, *flags)
    assert_same_losses(train_losses(one_node), train_losses(out), STEPS, tol=1e-5)
    assert_same_evals(one_node, out)
    assert summary(out)["fusions"] == summary(one_node)["fusions"] == 5  # steps 4, 8, 12, 16, 20


def payload(node) -> int:
    """What the node's interface sent, less the headers of its packets."""
    return node.tx_bytes - HEADER_BYTES * node.tx_packets


def test_ddp_sends_its_gradient_all_reduce_over_the_link(two_nodes):
    """Ranks 0 1 | 2 3: gloo's ring crosses the link once each way, so each node sends what one rank
    sends, 2(n-1)/n of the gradients a step (the summary's figure); node 0 also sends rank 0's
    parameters to the 2 ranks of node 1 once (DDP's broadcast at start)."""
    out, result = two_nodes("ddp")
    run = summary(out)
    per_step = run["gradient_allreduce_mib_per_step_per_rank"] * 2**20
    expected = [20 * per_step + 2 * 4 * run["n_params"], 20 * per_step]
    for node, want in zip(result.nodes, expected, strict=True):
        assert payload(node) == pytest.approx(want, rel=0.05), (node, want)
        assert node.tx_bytes > want  # the headers come on top, never less


def test_hsdp_sends_only_the_replicate_all_reduce_over_the_link(two_nodes):
    """Shard groups {0,1} {2,3} stay inside a node; replicate groups {0,2} {1,3} cross it: each of the node's
    2 ranks all-reduces its shard of the gradients with its peer, (2-1)/2 x 2 = 1 x the shard each way."""
    out, result = two_nodes("hsdp")
    counted = summary(out)["collectives_first_step_rank0"]
    replicate = 2 * counted["all_reduce"]["mib"] * 2**20  # 2 ranks a node, a 2-rank ring: the buffer each
    shard = 2 * (counted["all_gather"]["mib"] + counted["reduce_scatter"]["mib"]) * 2**20
    for node in result.nodes:
        assert payload(node) == pytest.approx(20 * replicate, rel=0.05), (node, replicate)
        assert payload(node) < 20 * (replicate + shard / 10)  # the shard collectives did not cross


def test_the_script_refuses_without_root_in_one_line(tmp_path):
    """Without root the script says so in one line and exits 2 (run as nobody when we are root)."""
    script = str(REPO / "slurm" / "local_nodes.py")
    code = f"import os, runpy, sys; os.geteuid = lambda: 1000; sys.argv = ['{script}', 'scripts/train_ddp.py']\n"
    code += f"runpy.run_path('{script}', run_name='__main__')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: local_nodes.py:") and "root" in lines[0], result.stderr


def leftovers(prefix: str) -> list[str]:
    """Namespaces and links whose names start with `prefix` (one run's)."""
    names = local_nodes._ip("netns", "list").stdout.split() + local_nodes._ip("-o", "link", "show").stdout.split()
    return [n.rstrip(":").split("@")[0] for n in names if n.startswith(prefix)]


def test_ctrl_c_and_a_failing_node_leave_nothing_behind(tmp_path):
    """Ctrl-C while the nodes run: exit 130, every process in the namespaces ended, no namespace, link or
    /etc/netns folder left; a script that fails: the launcher's exit code, and nothing left either."""
    if netns_reason():
        pytest.skip(netns_reason())
    script = tmp_path / "node.py"
    script.write_text(
        "import sys, time\nif sys.argv[1] == 'fail': sys.exit(3)\ntime.sleep(600 if sys.argv[1] == 'wait' else 0)\n"
    )
    cli = [sys.executable, str(REPO / "slurm" / "local_nodes.py"), "--nodes", "2"]
    proc = subprocess.Popen([*cli, str(script), "wait"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    prefix = f"ln{proc.pid}a"  # the launcher's one LocalNodes
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not local_nodes._ip("netns", "pids", f"{prefix}-n1").stdout.split():
            time.sleep(0.5)
        running = local_nodes._ip("netns", "pids", f"{prefix}-n1").stdout.split()
        assert running, "the nodes did not start"
        time.sleep(3)  # the agents are starting their workers
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert not leftovers(prefix) and not list(Path("/etc/netns").glob(f"{prefix}*"))
    assert not [pid for pid in running if psutil.pid_exists(int(pid))]

    failed = subprocess.Popen([*cli, str(script), "fail"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = failed.communicate(timeout=120)
    assert failed.returncode == 1 and "node 1: exit 1" in out, (out[-2000:], err[-2000:])
    assert not leftovers(f"ln{failed.pid}a") and not list(Path("/etc/netns").glob(f"ln{failed.pid}*"))


def test_rate_limits_both_ends_of_every_link():
    """--rate puts a tbf qdisc on the host end and on the node end of each veth; none is left after."""
    if netns_reason():
        pytest.skip(netns_reason())
    with local_nodes.LocalNodes(2, rate="50mbit") as made:
        for i, ns in enumerate(made.namespaces):
            host = local_nodes._quiet(["tc", "qdisc", "show", "dev", f"{made.prefix}h{i}"]).stdout
            node = local_nodes._quiet(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", "eth0"]).stdout
            assert "tbf" in host and "rate 50Mbit" in host, host
            assert "tbf" in node and "rate 50Mbit" in node, node
    assert not leftovers(made.prefix)


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def run_side_by_side(*jobs) -> list:
    """Run each job (a function of no arguments) in a thread of its own; their results, in order."""
    results: list = [None] * len(jobs)
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, jobs[i]())) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_the_interface_gloo_picks_cannot_reach_the_peers(tmp_path, data_cache):
    """Each node has eth0 (the nodes' network) and eth1 (a network of its own, which its host name resolves to),
    and no GLOO_SOCKET_IFNAME: gloo listens on eth1. preflight.py finds that the peers do not answer there but do
    on eth0, and says GLOO_SOCKET_IFNAME=eth0; train_ddp.py ends within --collective_timeout (10 s) with one
    `error:` line on each node naming GLOO_SOCKET_IFNAME=eth0, NCCL_SOCKET_IFNAME and eth1, never hanging
    (without the deadline, rank 0 waited 100 s in gloo's connect with a timeout of 20). Two pairs of nodes,
    side by side: both jobs spend most of their time waiting, not computing."""
    if netns_reason():
        pytest.skip(netns_reason())
    timeout, env = 10, job_env()
    train = [*TINY, "--max_steps", "4", "--collective_timeout", str(timeout), "--data_cache_dir", data_cache]
    check = ["--sizes", "4K", "--iters", "1", "--timeout", str(timeout), "--output", str(tmp_path / "pf.json")]
    with local_nodes.LocalNodes(2, decoy=True) as a, local_nodes.LocalNodes(2, decoy=True) as b:
        trained, checked = run_side_by_side(
            lambda: a.run(
                "scripts/train_ddp.py",
                [*train, "--output_dir", str(tmp_path / "ddp")],
                1,
                120,
                env,
                REPO,
                socket_ifname=None,
            ),
            lambda: b.run("scripts/preflight.py", check, 1, 120, env, REPO, socket_ifname=None),
        )
    assert not trained.timed_out and not checked.timed_out
    assert not leftovers(a.prefix) and not leftovers(b.prefix)  # eth1's veths too
    for node in trained.nodes:
        lines = error_lines(node.stderr)
        assert node.returncode == 1 and len(lines) == 1, (node.returncode, node.stderr[-3000:])
        line = lines[0]
        assert line.startswith(f"error: set-up: rank {node.rank} (host "), line
        # the deadline's words, or gloo's own where it gave up first
        assert f"(not connected after {timeout} s)" in line or "(Gloo connectFullMesh failed with " in line, line
        assert f"gloo listens on {a.decoy_addresses[node.rank]} (the address host name " in line, line
        assert "interface eth1), which the other nodes cannot reach" in line, line
        assert "set GLOO_SOCKET_IFNAME=eth0 (NCCL_SOCKET_IFNAME=eth0 on GPUs) on every node" in line, line
    # start-up (a few s a process on 2 cores) plus the 10 s: gloo alone waited 100 s with a timeout of 20
    assert trained.seconds < timeout + 40, f"took {trained.seconds:.0f} s"

    assert [n.returncode for n in checked.nodes] == [1, 1], checked.nodes[0].stderr[-3000:]
    lines = error_lines(checked.nodes[0].stderr)  # rank 0 prints the lines for the whole job
    assert lines and all("(No route to host; address from host name, interface eth1); its eth0" in x for x in lines)
    assert lines[-1].endswith(
        "reaches it: the collectives' address (host name) is on a network the other nodes cannot reach, and the "
        "interface that reaches the rendezvous reaches them: set GLOO_SOCKET_IFNAME=eth0 "
        "(NCCL_SOCKET_IFNAME=eth0 on GPUs) on every node"
    ), lines
    assert not (tmp_path / "pf.json").exists()


def test_a_link_down_for_20_s_mid_run_is_survived_exactly(nodes, tmp_path, data_cache):
    """Node 1's link is taken down (`ip link set <host end> down`) right after the checkpoint of step 4, and up
    again 20 s later. The collective in flight fails after --collective_timeout 15 s, torchrun (--max_restarts 3)
    starts the workers again, they resume from step 4 (--resume_from_checkpoint auto) once the link is back, and
    every step logged, the re-run ones too, has the uninterrupted run's loss, bit for bit. The uninterrupted
    run goes on a second pair of nodes while the link is down (the first pair only waits then)."""
    flags = [*TINY, "--n_layer", "4", "--max_steps", "12", "--batch_size", "8", "--data_cache_dir", data_cache]
    fault = [*flags, "--checkpoint_every", "4", "--resume_from_checkpoint", "auto", "--collective_timeout", "15"]
    out, straight, link = tmp_path / "down", tmp_path / "straight", f"{nodes.prefix}h1"
    events: dict = {}

    def cut_the_link():
        deadline = time.monotonic() + 180
        while not (out / "checkpoints" / "step_4").is_dir() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not (out / "checkpoints" / "step_4").is_dir():
            return
        local_nodes._must("link", "set", link, "down")
        events["down"] = time.monotonic()
        up = threading.Timer(20, lambda: (local_nodes._must("link", "set", link, "up"), events.update(up=1)))
        up.start()
        with local_nodes.LocalNodes(2) as other:
            events["straight"] = other.run(
                "scripts/train_ddp.py", [*flags, "--output_dir", str(straight)], 1, 180, job_env(), REPO
            )
        up.join()

    cutter = threading.Thread(target=cut_the_link, daemon=True)
    cutter.start()
    try:
        result = nodes.run(
            "scripts/train_ddp.py",
            [*fault, "--output_dir", str(out)],
            1,
            timeout=240,
            env=job_env(),
            cwd=REPO,
            launcher_args=["--max_restarts", "3"],
        )
        cutter.join(200)
    finally:
        local_nodes._ip("link", "set", link, "up")
    assert "down" in events and events.get("up"), "the link was not taken down and up again"
    assert events["straight"].returncode == 0, events["straight"].nodes[1].stderr[-3000:]
    for node in result.nodes:
        assert node.returncode == 0, f"node {node.rank}: exit {node.returncode}\n{node.stderr[-4000:]}"
    assert "--resume_from_checkpoint auto: resuming from" in result.nodes[0].stdout  # a restart happened
    records = read_metrics(out)
    train = [r for r in records if r["type"] == "train"]
    expected = train_losses(straight)
    assert {r["step"] for r in train} == set(range(1, 13)), "no step may be missing"
    assert [(r["step"], r["loss"]) for r in train if r["loss"] != expected[r["step"]]] == []  # exact
    resumed = [r["step"] for r in train if r.get("resumed")]
    assert resumed and all(step > 4 for step in resumed), resumed  # the first record after each restart
    assert [r["final_step"] for r in records if r["type"] == "summary"] == [12]


def pending_sigterm(pid: int) -> bool:
    """Whether SIGTERM waits to be delivered to process `pid` (a stopped process keeps it pending)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return False
    return any(line.startswith(("SigPnd", "ShdPnd")) and int(line.split()[1], 16) & 1 << 14 for line in status)


def wait_for(condition, what: str, seconds: float = 180, proc=None) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {seconds} s"
        assert proc is None or proc.poll() is None, f"{what}: the launcher ended first (exit {proc.returncode})"
        time.sleep(0.05)


def records_of(out: Path) -> list[dict]:
    return read_metrics(out) if (out / "metrics.jsonl").is_file() else []


def lose_node_1_after(made, out: Path, checkpoint: str, flags: list[str], script: str, logs: Path):
    """Start `script` on 2 elastic nodes (torchrun --nnodes 1:2 --max_restarts 3), lose node 1 for good once
    `checkpoint` is written; returns (node 0's launcher, the command and environment to start node 1 again)."""
    env = made.node_env(job_env(), elastic=True)
    command = [made.node_command(r, script, flags, 1, ["--max_restarts", "3"], elastic=True) for r in range(2)]
    node0 = made.start(0, command[0], env, REPO, open(logs / "node0.log", "w"))
    node1 = made.start(1, command[1], env, REPO, open(logs / "node1.log", "w"))
    wait_for(lambda: (out / "checkpoints" / checkpoint).is_dir(), f"checkpoint {checkpoint}", proc=node0)
    made.lose_node(1)  # its link down, every process on it killed: silence, as a machine that died
    node1.wait(30)
    return node0, command[1], env


ELASTIC = ["--resume_from_checkpoint", "auto", "--collective_timeout", "10", "--keep_last", "0"]
ELASTIC_STEPS = 24
DILOCO_ELASTIC = [*TINY, "--max_steps", "16", "--batch_size", "4", "--global_batch_size", "16", *ELASTIC]
DILOCO_ELASTIC += ["--outer_optimizer", "nesterov", "--sync_every", "4", "--checkpoint_every", "6"]


def ddp_loses_node_1_and_takes_it_back(folder: Path, data_cache: str) -> dict:
    """DDP on 2 elastic nodes, one process each, --batch_size 4 --global_batch_size 16: node 1 lost for good
    after the checkpoint of step 4; once node 0 trains alone, node 1 comes back (its launcher started again).
    Node 0's worker is stopped (SIGSTOP) while node 1 joins, so that a tiny run cannot finish first: it
    receives torchrun's SIGTERM for the new round, then goes on (a checkpoint at its step, exit 0)."""
    out = folder / "run"
    flags = [*TINY, "--max_steps", str(ELASTIC_STEPS), "--batch_size", "4", "--global_batch_size", "16", *ELASTIC]
    flags += ["--checkpoint_every", "4", "--data_cache_dir", data_cache, "--output_dir", str(out)]
    with local_nodes.LocalNodes(2) as made:
        node0, again, env = lose_node_1_after(made, out, "step_4", flags, "scripts/train_ddp.py", folder)
        lost = time.monotonic()
        alone = lambda: any(r["type"] == "train" and r["world_size"] == 1 for r in records_of(out))  # noqa: E731
        wait_for(alone, "node 0 training alone after the loss", proc=node0)
        alone_after = time.monotonic() - lost
        under_node0 = psutil.Process(node0.pid).children(recursive=True)
        workers = [p for p in under_node0 if "train_ddp.py" in " ".join(p.cmdline()) and "-m" not in p.cmdline()]
        assert len(workers) == 1, workers
        workers[0].send_signal(signal.SIGSTOP)
        made.restore_node(1)
        node1 = made.start(1, again, env, REPO, open(folder / "node1-back.log", "w"))
        back = time.monotonic()
        try:
            wait_for(lambda: pending_sigterm(workers[0].pid), "torchrun's SIGTERM for the joining node", 120, node1)
            joined_after = time.monotonic() - back
        finally:
            workers[0].send_signal(signal.SIGCONT)
        codes = [node0.wait(240), node1.wait(240)]
    logs = "\n".join(f.read_text()[-3000:] for f in sorted(folder.glob("node*.log")))
    return {"out": out, "codes": codes, "logs": logs, "alone_after": alone_after, "joined_after": joined_after}


def diloco_loses_node_1(folder: Path, data_cache: str) -> dict:
    """DiLoCo (K 4) on 2 elastic nodes, one replica each, a checkpoint every 6 steps: node 1 lost for good after
    the checkpoint of step 6, 2 local steps after the fusion of step 4."""
    out = folder / "run"
    flags = [*DILOCO_ELASTIC, "--data_cache_dir", data_cache, "--output_dir", str(out)]
    with local_nodes.LocalNodes(2) as made:
        node0, _, _ = lose_node_1_after(made, out, "step_6", flags, "scripts/train_localsgd.py", folder)
        code = node0.wait(240)
    return {"out": out, "codes": [code], "logs": (folder / "node0.log").read_text()}


@pytest.fixture(scope="module")
def elastic_runs(tmp_path_factory, data_cache) -> dict:
    """Both elastic scenarios, side by side on two pairs of nodes (they spend most of their time waiting)."""
    if netns_reason():
        pytest.skip(netns_reason())
    folders = [tmp_path_factory.mktemp("elastic_ddp"), tmp_path_factory.mktemp("elastic_diloco")]
    errors: list = []

    def guarded(job, folder):
        def run():
            try:
                return job(folder, data_cache)
            except BaseException as error:  # a failed wait: reported by the tests, not lost in a thread
                errors.append(error)

        return run

    ddp, diloco = run_side_by_side(
        guarded(ddp_loses_node_1_and_takes_it_back, folders[0]), guarded(diloco_loses_node_1, folders[1])
    )
    if errors:
        raise errors[0]
    return {"ddp": ddp, "diloco": diloco}


def test_a_node_lost_for_good_then_back_ddp_keeps_its_batches(elastic_runs, reference):
    """Node 1 lost after step 4: node 0's step waits --collective_timeout (10 s), torchrun restarts its worker
    alone, which resumes from step 4 on 1 rank with accumulation 4: the same global batches. Node 1 comes back:
    at the restart its arrival causes, both resume on 2 ranks. Every step of the three parts has the
    single-process run's loss (1e-5), none is missing."""
    run = elastic_runs["ddp"]
    assert run["codes"] == [0, 0], run["logs"]
    print(f"node 0 trained alone {run['alone_after']:.0f} s after the loss; node 1 joined {run['joined_after']:.0f} s")
    records = read_metrics(run["out"])
    parts = [r for r in records if r["type"] == "summary"]
    assert [(p["world_size"], p["global_batch_size"]) for p in parts] == [(1, 16), (2, 16)], parts  # the first died
    assert parts[0]["preempted"] and parts[-1]["final_step"] == ELASTIC_STEPS
    train = [r for r in records if r["type"] == "train"]
    assert [r["world_size"] for r in train if r.get("resumed")] == [1, 2]
    assert {r["step"] for r in train} == set(range(1, ELASTIC_STEPS + 1)), "no step may be missing"
    expected = train_losses(reference("--max_steps", str(ELASTIC_STEPS), "--batch_size", "16"))
    worst = max(abs(r["loss"] - expected[r["step"]]) for r in train)  # every record, the re-run steps too
    assert worst <= 1e-5, worst
    assert (run["out"] / "model" / "model.safetensors").is_file()


def test_diloco_goes_on_with_fewer_replicas_from_the_last_fusion(elastic_runs, tmp_path, data_cache):
    """The survivor resumes from step 6 as the one replica left, from θ at the fusion of step 4 (with the outer
    momentum), says so in one line, and fuses on at steps 8, 12, 16. Its losses are those of a one-process
    resume of a copy of that checkpoint, exactly."""
    run, copy = elastic_runs["diloco"], tmp_path / "copy"
    assert run["codes"] == [0], run["logs"][-4000:]
    line = "2 replicas saved the checkpoint, 1 resume it: every replica continues from the model of the last fusion "
    assert line + "(step 4), dropping the 2 local steps since it" in run["logs"], run["logs"][-4000:]
    shutil.copytree(run["out"] / "checkpoints" / "step_6", copy / "checkpoints" / "step_6")
    resume = ["--resume_from_checkpoint", str(copy / "checkpoints" / "step_6"), "--output_dir", str(copy)]
    launch("train_localsgd.py", [*DILOCO_ELASTIC, "--data_cache_dir", data_cache, *resume])
    train = [r for r in read_metrics(run["out"]) if r["type"] == "train"]
    alone = {r["step"]: r["loss"] for r in train if r["world_size"] == 1}
    assert sorted(alone) == list(range(7, 17)) and alone == train_losses(copy)
    assert [r["step"] for r in train if r["world_size"] == 1 and r["fused"]] == [8, 12, 16]
    assert summary(run["out"])["fusions"] == 3 and summary(run["out"])["world_size"] == 1
