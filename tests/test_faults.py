"""A kill in the middle of a save: the previous complete checkpoint survives (`--keep_last 1`
included), `--resume_from_checkpoint auto` continues from it, and the run ends with the
uninterrupted run's losses. The save is caught by watching for its temporary directory
(`checkpoints/.tmp_step_N`), not by a timed guess."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import psutil
import pytest
import torch

from conftest import (
    REPO,
    SCRIPTS,
    TINY,
    assert_same_losses,
    job_env,
    kill_tree,
    launch,
    launch_cmd,
    read_metrics,
    train_losses,
)

sys.path.insert(0, str(SCRIPTS))
from common import checkpoint, checkpoint_save, resume_checks
from common.model import GPT, GPTConfig

STEPS = 10
# small is 4 layers x 128: its sharded save lasts long enough to be caught between the appearance
# of .tmp_step_10 and its rename. Step 10 is the last: its checkpoint is the one killed
FLAGS = [
    *TINY,
    "--model_size",
    "small",
    "--max_steps",
    str(STEPS),
    "--batch_size",
    "8",
    "--checkpoint_every",
    "5",
    "--keep_last",
    "1",
    "--resume_from_checkpoint",
    "auto",
]


def kill_rank_during_save(script: str, args: list[str], out, step: int, rank: int) -> tuple[str, int]:
    """Launch on 2 processes; the moment checkpoints/.tmp_step_<step> appears, SIGKILL `rank`.
    Returns the launch's stderr and the killed process's pid."""
    proc = subprocess.Popen(
        launch_cmd(script, [*args, "--output_dir", str(out)], nproc=2),
        cwd=REPO,
        env=job_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    tmp = out / "checkpoints" / f".tmp_step_{step}"
    try:
        deadline = time.monotonic() + 240
        while not tmp.is_dir():  # a tight poll: the save lasts a fraction of a second
            assert time.monotonic() < deadline and proc.poll() is None, "the run ended before the save"
            time.sleep(0.001)
        workers = [p for p in psutil.Process(proc.pid).children(recursive=True) if script in " ".join(p.cmdline())]
        victim = next(p for p in workers if p.environ().get("RANK") == str(rank))
        victim.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode != 0, "the launch must report the killed rank"
        return err, victim.pid
    finally:
        kill_tree(proc.pid)


def test_kill_during_a_sharded_save_resumes_from_the_previous_checkpoint(tmp_path, data_cache):
    """FSDP on 2 processes (each rank writes its own shards), --keep_last 1: rank 1 is killed while
    the last step's checkpoint (step 10) is being written. step_5, the only complete checkpoint,
    must survive and be the one `auto` resumes from. Steps 1-10 of the killed run are an
    uninterrupted run's: the resumed run's steps 6-10 must equal them."""
    args = [*FLAGS, "--data_cache_dir", data_cache]
    out = tmp_path / "run"
    err, killed = kill_rank_during_save("train_fsdp.py", args, out, step=STEPS, rank=1)
    # the surviving rank says what happened, in one line (a dead peer: its connections closed), and which
    # peer it lost: a SIGKILL leaves no traceback, so rank 1 is named from its pid, gone from this host
    line = re.search(rf"error: step {STEPS}: \S+.* lost its connection to a peer.*", err)
    assert line, err[-3000:]
    host = re.escape(socket.gethostname())  # ", killed by SIGKILL" where the launcher has not collected it yet
    named = rf"Rank 1 \(pid {killed} on host {host}(, killed by SIGKILL)?\) is gone\. "
    assert re.search(named, line[0]), line[0]
    checkpoints = out / "checkpoints"
    assert not (checkpoints / f"step_{STEPS}").exists(), (
        "the kill came after the save completed: the test proved nothing"
    )
    assert (checkpoints / "step_5").is_dir(), "--keep_last 1 deleted the only complete checkpoint"
    uninterrupted = train_losses(out)
    assert sorted(uninterrupted) == list(range(1, STEPS + 1)), "the killed run logs every step before the save"

    result = launch("train_fsdp.py", [*args, "--output_dir", str(out)], nproc=2)
    assert f"--resume_from_checkpoint auto: resuming from {checkpoints / 'step_5'}" in result.stdout
    train = [r for r in read_metrics(out) if r["type"] == "train"]
    rerun = train[STEPS:]
    assert [r["step"] for r in rerun] == list(range(6, STEPS + 1)) and rerun[0].get("resumed")
    assert_same_losses(uninterrupted, {r["step"]: r["loss"] for r in rerun}, range(6, STEPS + 1), tol=1e-5)
    assert sorted(p.name for p in checkpoints.iterdir()) == [f"step_{STEPS}"], "leftovers of the killed save remain"
    assert (out / "model" / "model.safetensors").is_file()


# ------------------------------------------------------------------ the save's order, in one process
def one_process_run():
    """A tiny model, optimizer and schedule, and a stand-in for the Accelerator of one process."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.zeros(1, 8, dtype=torch.long)).sum().backward()
    optimizer.step()  # the optimizer has state to save
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    accelerator = SimpleNamespace(
        is_main_process=True, process_index=0, num_processes=1, wait_for_everyone=lambda: None
    )
    return accelerator, model, optimizer, scheduler


def state(step: int) -> dict:
    config = GPTConfig.from_preset("tiny").to_dict()
    shapes = {name: list(p.shape) for name, p in GPT(GPTConfig.from_preset("tiny")).named_parameters()}
    return {"step": step, "epoch": 0, "samples_in_epoch": 0, "global_batch_size": 8, "world_size": 1} | {
        "seed": 0,
        "param_shapes": shapes,
        "model_config": config,
    }


def test_keep_last_deletes_only_after_the_new_checkpoint_is_complete(tmp_path, monkeypatch):
    """Every deletion of a checkpoint happens while a newer complete one exists; a save that dies
    while writing leaves the previous checkpoint readable; the next save clears its leftovers."""
    accelerator, model, optimizer, scheduler = one_process_run()
    args = SimpleNamespace(output_dir=tmp_path, keep_last=1)

    def save(step: int):
        facts = {k: v for k, v in state(step).items() if k not in ("step", "epoch", "samples_in_epoch")}
        feed = SimpleNamespace(position=lambda: {"epoch": 0, "samples_in_epoch": 0}, dp_group=None)
        return checkpoint.save_checkpoint(accelerator, args, step, feed, model, optimizer, scheduler, facts)

    save(5)
    deleted = []
    real_rmtree = checkpoint.shutil.rmtree

    def watched_rmtree(path, *args, **kwargs):
        if path.name.startswith("step_"):  # a complete checkpoint goes: a newer one must be readable
            newest = checkpoint.list_checkpoints(tmp_path)[-1]
            assert newest != path, f"{path.name} deleted while it is the newest complete checkpoint"
            resume_checks.read_checkpoint_state(newest)
            deleted.append(path.name)
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.shutil, "rmtree", watched_rmtree)
    save(10)
    assert deleted == ["step_5"]

    def dies_while_writing(state_dict, checkpoint_id, **kwargs):
        (checkpoint.Path(checkpoint_id) / "__0_0.distcp").parent.mkdir(parents=True, exist_ok=True)
        (checkpoint.Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"half a shard")
        raise KeyboardInterrupt  # what a kill looks like from here: the save stops midway

    real_dcp_save = checkpoint_save.dcp.save
    monkeypatch.setattr(checkpoint_save.dcp, "save", dies_while_writing)
    with pytest.raises(KeyboardInterrupt):
        save(15)
    checkpoints = checkpoint.list_checkpoints(tmp_path)
    assert [p.name for p in checkpoints] == ["step_10"]
    assert resume_checks.read_checkpoint_state(tmp_path / "checkpoints" / "step_10")["step"] == 10
    assert checkpoint.resolve_checkpoint("auto", tmp_path) == tmp_path / "checkpoints" / "step_10"
    _, fresh_model, fresh_optimizer, fresh_scheduler = one_process_run()
    with torch.no_grad():
        fresh_model.lm_head.weight.zero_()
    loaded = checkpoint.load_checkpoint(accelerator, checkpoints[-1], fresh_model, fresh_optimizer, fresh_scheduler)
    assert loaded["step"] == 10 and torch.equal(fresh_model.lm_head.weight, model.lm_head.weight)

    monkeypatch.setattr(checkpoint_save.dcp, "save", real_dcp_save)
    save(20)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_20"], "the interrupted save's leftovers remain"
    assert deleted == ["step_5", "step_10"]
    assert json.loads((tmp_path / "checkpoints" / "step_20" / "trainer_state.json").read_text())["step"] == 20


def test_a_rank_that_crashes_keeps_its_traceback_and_its_peer_names_it(tmp_path, data_cache):
    """Rank 1 raises an error of its own at step 2 (tests/cut_check_driver.py's `crash`): its traceback is
    kept in OUTPUT_DIR/logs/traceback_rank1.txt, and rank 0, which loses it, names the file in its one line
    (it said only "its own output says why", and that output was lost among the launcher's)."""
    out = tmp_path / "run"
    args = ["crash", str(SCRIPTS / "train_ddp.py"), *TINY, "--max_steps", "4", "--batch_size", "8"]
    args += ["--data_cache_dir", data_cache, "--output_dir", str(out), "--collective_timeout", "60"]
    result = subprocess.run(
        launch_cmd("../tests/cut_check_driver.py", args, nproc=2),
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    kept = out / "logs" / "traceback_rank1.txt"
    assert result.returncode != 0 and kept.is_file(), result.stderr[-3000:]
    assert "ValueError: a bug of rank 1's own, at step 2" in kept.read_text()
    # not "a line that starts with": rank 0's progress bar (tqdm, no newline) can precede its line
    lost = re.findall(r"error: [^\n]*seen by rank 0[^\n]*", result.stderr)
    assert lost and str(kept) in lost[0], result.stderr[-3000:]


# ------------------------------------------------------------------ which peer, in one process
def test_the_lost_peer_is_named_from_its_process_or_gloos_address_and_never_guessed(tmp_path, monkeypatch):
    """peers.named_peers on a table of peers as record_peers gathers it, without a launch: processes of
    this machine (`sleep`) killed, reaped, stopped, running, or gone after marking themselves survivors; and
    peers on other hosts, found only by the address in gloo's message. Only what is known is said: a survivor
    that left first, a running peer, an address that two hosts hold, or one of this host's, names nobody."""
    from common import faults, peer_records, peers
    from common.run_state import RunPosition

    monkeypatch.setattr(faults.torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(faults.torch.distributed, "get_rank", lambda: 0)
    monkeypatch.setattr(RunPosition, "output_dir", str(tmp_path))
    monkeypatch.setattr(RunPosition, "started", time.time() - 1)
    me = peer_records.this_process()
    host = socket.gethostname()
    sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(5)]
    try:

        def peer(rank: int, proc=None, **facts) -> dict:
            started = peer_records.proc_stat(proc.pid)[19] if proc else None
            return me | {"rank": rank, "pid": proc.pid if proc else 0, "started": started} | facts

        killed, reaped, stopped, running, survivor = sleepers
        table = [me, peer(1, killed), peer(2, reaped), peer(3, stopped), peer(4, running), peer(5, survivor)]
        table.append(peer(6, running, started="1"))  # its pid, since taken by another process
        elsewhere = {"pid_space": "machine b", "net_space": "machine b", "host": "b", "addresses": ["10.0.0.2"]}
        table.append(peer(7, **elsewhere))
        for rank, name in ((8, "c"), (9, "c"), (10, "d")):  # c: 2 ranks; c and d both hold a docker bridge's
            where = {"pid_space": f"machine {name}", "net_space": f"machine {name}", "host": name}
            table.append(peer(rank, **where, addresses=["10.0.0.3", "172.17.0.1"] if name == "c" else ["172.17.0.1"]))
        monkeypatch.setattr(peer_records, "PEERS", table)

        def named(address: str = "127.0.0.1") -> str:
            return peers.named_peers(RuntimeError(f"Connection closed by peer [{address}]:4528"))

        assert named() == f" Rank 6 (pid {running.pid} on host {host}) is gone."  # the others are alive
        (tmp_path / "logs" / "survivor_rank5.pid").write_text(f"{survivor.pid}\n")
        for proc in (killed, reaped, survivor):
            proc.send_signal(signal.SIGKILL)
        reaped.wait(), survivor.wait()
        stopped.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while [peer_records.proc_stat(p.pid)[0] for p in (killed, stopped)] != ["Z", "T"]:
            assert time.monotonic() < deadline, "the signals did not arrive"
            time.sleep(0.01)
        this_host = [
            f" Ranks 1 (pid {killed.pid} on host {host}, killed by SIGKILL), 2 (pid {reaped.pid} on host {host}) and"
            f" 6 (pid {running.pid} on host {host}) are gone (a launcher ends its other workers when one fails: its"
            ' "Root Cause (first observed failure)" names the first).',
            f" Rank 3 (pid {stopped.pid} on host {host}) is stopped (SIGSTOP or a debugger).",
        ]
        assert named() == "".join(this_host)
        assert (tmp_path / "logs" / "survivor_rank0.pid").read_text() == f"{os.getpid()}\n"
        assert named("10.0.0.2") == "".join(this_host) + " Gloo's peer 10.0.0.2 is rank 7 (host b)."
        assert named("10.0.0.3") == "".join(this_host) + " Gloo's peer 10.0.0.3 is one of ranks 8, 9 (host c)."
        for unknown in ("172.17.0.1", "10.0.0.9", *me["addresses"]):  # two hosts, nobody's, this host's
            assert named(unknown) == "".join(this_host), unknown

        table[1:] = [peer(1, killed)]  # the SIGKILL of tests above: one peer, and it is named
        assert named() == f" Rank 1 (pid {killed.pid} on host {host}, killed by SIGKILL) is gone."
        monkeypatch.setattr(RunPosition, "output_dir", None)  # no mark can be left: a gone peer may be a survivor
        assert named() == ""
    finally:
        for proc in sleepers:
            proc.kill()
            proc.wait()


def test_a_peer_still_being_ended_is_named(monkeypatch):
    """A SIGKILLed process's sockets close (its peers see "Connection reset") before the kernel makes it a
    zombie; on a loaded machine a peer can look in between, and the lost rank went unnamed. /proc's flags say
    the kernel is ending it (PF_EXITING): named once it is a zombie, with how it ended, or after a second
    without. /proc is replayed here: the window is too short to hit on purpose."""
    from common import peer_records, peers

    def stat(state: str, flags: int, status: int = 0) -> list[str]:
        fields = ["0"] * 50
        fields[0], fields[6], fields[19], fields[49] = state, str(flags), "7", str(status)
        return fields

    peer = {"pid": 4242, "started": "7"}
    ending, killed = stat("R", peers.PF_EXITING), stat("Z", peers.PF_EXITING, status=signal.SIGKILL)
    reads = iter([ending, ending, killed])
    monkeypatch.setattr(peer_records, "proc_stat", lambda pid: next(reads))
    assert peers.state_of(peer) == ("gone", ", killed by SIGKILL")
    monkeypatch.setattr(peer_records, "proc_stat", lambda pid: ending)
    assert peers.state_of(peer) == ("gone", "")
    monkeypatch.setattr(peer_records, "proc_stat", lambda pid: stat("S", 0x400000))  # running: maybe a survivor
    assert peers.state_of(peer) is None


def test_a_peer_killed_during_evaluate_py_leaves_one_line(tmp_path, data_cache):
    """evaluate.py has no preemption handler: when rank 1 is SIGKILLed, the launcher ends rank 0 with SIGTERM,
    which ended it in silence (exit != 0, no line). Now rank 0 says so in one line."""
    launch(
        "train_ddp.py",
        [
            *TINY,
            "--max_steps",
            "1",
            "--eval_every",
            "0",
            "--data_cache_dir",
            data_cache,
            "--output_dir",
            str(tmp_path / "run"),
        ],
        nproc=1,
    )
    args = ["killed", str(SCRIPTS / "evaluate.py"), "--model_dir", str(tmp_path / "run" / "model")]
    args += ["--data_cache_dir", data_cache, "--collective_timeout", "60"]
    result = subprocess.run(
        launch_cmd("../tests/cut_check_driver.py", args, nproc=2),
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    ended = re.findall(
        r"error: evaluate.py was ended by SIGTERM: a launcher ends every process when one fails", result.stderr
    )
    assert result.returncode != 0 and ended, result.stderr[-3000:]
