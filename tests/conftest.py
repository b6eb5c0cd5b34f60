"""Helpers for tests that launch real multi-process jobs on the CPU (gloo).

Every launch gets a free port, loopback networking, one thread per process, a timeout, and
its whole process group killed if it overruns, so a hung test cannot leave ranks behind.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
from _pytest.nodeid import coerce_node_id

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
CPU_MULTI = REPO / "accelerate_configs" / "cpu_multi.yaml"
LAUNCH_TIMEOUT = 300


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Keep tests marked xdist_group(name) on one pytest-xdist worker (pytest.ini: --dist loadgroup).
    xdist 3.8 does it by renaming each test to `<id>@name`, but it writes `item._nodeid`, which
    pytest 9 no longer reads; without this the marks are ignored and shared runs launch twice."""
    if not getattr(config.option, "loadgroup", False):  # set in xdist's workers only
        return
    for item in items:
        mark = item.get_closest_marker("xdist_group")
        if mark is not None and "@" not in item.nodeid.rsplit("]", 1)[-1]:
            item._id = coerce_node_id(f"{item.nodeid}@{mark.args[0]}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_env(**extra) -> dict:
    env = dict(os.environ)
    env.update(
        # gloo would otherwise pick an interface itself
        # (docs/troubleshooting.md, "Gloo picks the wrong network interface")
        GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        TQDM_DISABLE="1",
        PYTHONUNBUFFERED="1",
    )
    env.pop("ACCELERATE_CONFIG_FILE", None)
    env.update(extra)
    return env


def kill_tree(pid: int) -> None:
    """Kill a launcher and every process under it: torchrun starts its workers in sessions of
    their own, so killing the launcher's process group would leave them running."""
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def run_cmd(
    cmd: list[str], timeout: float = LAUNCH_TIMEOUT, env: dict | None = None, cwd: Path = REPO
) -> subprocess.CompletedProcess:
    """Run a command in its own session (in `cwd`, the repository by default); on timeout kill every
    process it started."""
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env or job_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s: {' '.join(cmd)}\n{out[-3000:]}\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def launch_cmd(script: str, args: list[str], nproc: int = 1) -> list[str]:
    """`python scripts/X.py` for one process; `accelerate launch` with cpu_multi.yaml for more."""
    path = str(SCRIPTS / script)
    if nproc == 1:
        return [sys.executable, path, *args]
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(CPU_MULTI),
        "--num_processes",
        str(nproc),
        "--main_process_port",
        str(free_port()),
        path,
        *args,
    ]


def accelerate_launch_cmd(launch_flags: list[str], script: str, args: list[str]) -> list[str]:
    """`accelerate launch` given its flags on the command line instead of a config file (fp32, no dynamo)."""
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *launch_flags,
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        f"scripts/{script}",
        *args,
    ]


def launch(
    script: str, args: list[str], nproc: int = 1, check: bool = True, timeout: float = LAUNCH_TIMEOUT
) -> subprocess.CompletedProcess:
    result = run_cmd(launch_cmd(script, args, nproc), timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(
            f"exit {result.returncode}: {' '.join(result.args)}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
        )
    return result


# Runs `python scripts/<script> <args>` for several one-process cases in one interpreter (as __main__, with that
# argv and environment), so that torch and the rest are imported once: for runs that stop at start (a refusal,
# --help).
ONE_INTERPRETER = """
import contextlib, io, json, os, runpy, sys
cases, results = json.loads(sys.argv[1]), []
for script, args, env in cases:
    saved, out, err, code = dict(os.environ), io.StringIO(), io.StringIO(), 0
    os.environ.update(env)
    sys.argv = [script, *args]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except Exception as error:
            code = 1
            err.write(f"{type(error).__name__}: {error}")
    os.environ.clear()
    os.environ.update(saved)
    results.append({"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()})
print(json.dumps(results))
"""


def run_refused(cases: list[tuple], timeout: float = LAUNCH_TIMEOUT) -> list[SimpleNamespace]:
    """Each (script, args[, env]) as `python scripts/<script> <args>` would run it, all in one interpreter; for
    each, its exit code and what it wrote to stdout and stderr. Only for runs that stop at start: a case that
    trains would train in this interpreter, after the others."""
    cases = [(str(SCRIPTS / c[0]), [str(a) for a in c[1]], c[2] if len(c) > 2 else {}) for c in cases]
    result = run_cmd([sys.executable, "-c", ONE_INTERPRETER, json.dumps(cases)], timeout=timeout, env=job_env())
    assert result.returncode == 0, result.stderr[-3000:]
    return [SimpleNamespace(**r) for r in json.loads(result.stdout.strip().splitlines()[-1])]


def read_metrics(output_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def local_sgd_reference(flags: list, replicas: int, out: Path, data_cache: str) -> tuple[dict, float]:
    """tests/localsgd_reference.py: train_localsgd.py's run on `replicas` processes, computed in one process with
    the replicas side by side (TINY, then `flags`) -> ({step: loss}, the fused model's eval loss)."""
    result = Path(out) / "reference.json"
    cmd = [sys.executable, str(REPO / "tests" / "localsgd_reference.py"), "--replicas", str(replicas)]
    cmd += ["--result", str(result), *TINY, *flags, "--data_cache_dir", data_cache, "--output_dir", str(out)]
    done = run_cmd(cmd)
    assert done.returncode == 0, done.stderr[-3000:]
    ref = json.loads(result.read_text())
    return {int(step): loss for step, loss in ref["losses"].items()}, ref["eval_loss"]


def train_losses(output_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(output_dir) if r["type"] == "train"}


def assert_same_losses(a: dict, b: dict, steps, tol: float) -> None:
    missing = [s for s in steps if s not in a or s not in b]
    assert not missing, f"steps missing from metrics: {missing}"
    worst = max(steps, key=lambda s: abs(a[s] - b[s]))
    assert abs(a[worst] - b[worst]) <= tol, (
        f"step {worst}: {a[worst]} vs {b[worst]} (|diff| {abs(a[worst] - b[worst]):.3g} > {tol})"
    )


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> str:
    """One data cache for the session: the built-in sets are built once."""
    return str(tmp_path_factory.mktemp("data_cache"))


# Common flags of the small runs the tests compare: tiny model, fp32, a loss record every step.
TINY = ["--model_size", "tiny", "--log_every", "1", "--eval_every", "0", "--warmup_steps", "5"]


def launch_tiny(script: str, out, data_cache: str, *flags: str, **kwargs) -> subprocess.CompletedProcess:
    """`script` with TINY, then `flags`, on the session's data cache, writing to `out`; kwargs go to launch()."""
    return launch(script, [*TINY, *flags, "--data_cache_dir", data_cache, "--output_dir", str(out)], **kwargs)


@pytest.fixture(scope="session")
def text_files(tmp_path_factory):
    """Text of this Python's argparse.py as --train_file (and its first 2,300 characters as --validation_file):
    context parallel's long sequences (tests/test_cp.py, tests/test_cp_ulysses.py)."""
    import argparse

    folder = tmp_path_factory.mktemp("cp_text")
    source = open(argparse.__file__, encoding="utf-8").read()
    (folder / "train.txt").write_text(source)
    (folder / "validation.txt").write_text(source[:2300])
    return ["--train_file", str(folder / "train.txt"), "--validation_file", str(folder / "validation.txt")]


@pytest.fixture(scope="session")
def reference(shared_run):
    """The single-process train_ddp.py run every strategy is compared with, built once per
    set of flags for the whole session: reference(*flags) -> its output directory;
    reference.in_turn([flags, ...]) runs those not run yet in one interpreter (SharedRuns.in_turn)."""

    def run(*flags: str) -> Path:
        return shared_run("train_ddp.py", 1, *flags)

    run.in_turn = lambda flag_sets: shared_run.in_turn([("train_ddp.py", 1, *flags) for flags in flag_sets])
    return run


def run_in_turn(cases: list, nproc: int, folder: Path, cwd: Path = REPO) -> list[dict]:
    """Every case [script path, args] in one launch of `nproc` processes (tests/zoo_driver.py: start-up, not
    training, is what a tiny run costs here), run in `cwd` -> [{"returncode", "stdout", "stderr"}, ...],
    rank 0's. The scripts' folder (that of the first case) is put on the path: a copy of them runs as itself."""
    folder.mkdir(parents=True, exist_ok=True)
    spec, results = folder / "cases.json", folder / "results.json"
    spec.write_text(json.dumps({"cases": cases, "results": str(results)}))
    driver = launch_cmd("../tests/zoo_driver.py", [str(spec)], nproc=nproc)
    done = run_cmd(driver, timeout=4 * LAUNCH_TIMEOUT, cwd=cwd)
    assert results.is_file(), f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return json.loads(results.read_text())


class SharedRuns:
    """shared_run(script, nproc, *flags) -> the output directory of that run (TINY and the data cache are
    added), launched once for the whole session; tests read it and never write into it.
    shared_run.in_turn([(script, nproc, *flags), ...]) launches those not launched yet, the runs of one
    process count in ONE launch, one after the other (run_in_turn), so a group of parity tests pays the
    start-up once per process count; call it first in each test of the group, with the group's whole list."""

    def __init__(self, tmp_path_factory, data_cache: str):
        self.tmp_path_factory, self.data_cache = tmp_path_factory, data_cache
        self.cache: dict[tuple, Path] = {}
        self.stdout: dict[tuple, str] = {}  # rank 0's (its last 8,000 characters when run in turn)

    def __call__(self, script: str, nproc: int, *flags: str) -> Path:
        key = (script, nproc, flags)
        if key not in self.cache:
            out = self.tmp_path_factory.mktemp("shared") / "run"
            self.stdout[key] = launch_tiny(script, out, self.data_cache, *flags, nproc=nproc).stdout
            self.cache[key] = out
        return self.cache[key]

    def said(self, script: str, nproc: int, *flags: str) -> str:
        """What that run printed on rank 0's stdout (its start lines, its summary)."""
        self(script, nproc, *flags)
        return self.stdout[(script, nproc, flags)]

    def in_turn(self, runs: list[tuple]) -> None:
        todo = {}
        for script, nproc, *flags in runs:
            if (script, nproc, tuple(flags)) not in self.cache:
                todo.setdefault(nproc, {})[(script, nproc, tuple(flags))] = None
        for nproc, keys in todo.items():
            folder = self.tmp_path_factory.mktemp(f"shared_in_turn_{nproc}")
            outs = [folder / f"run{i}" for i in range(len(keys))]
            cases = [
                [str(SCRIPTS / script), [*TINY, *flags, "--data_cache_dir", self.data_cache, "--output_dir", str(out)]]
                for (script, _, flags), out in zip(keys, outs, strict=True)
            ]
            for (key, out), result in zip(zip(keys, outs, strict=True), run_in_turn(cases, nproc, folder), strict=True):
                assert result["returncode"] == 0, f"exit {result['returncode']}: {key}\n{result['stderr'][-5000:]}"
                self.cache[key], self.stdout[key] = out, result["stdout"]


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory, data_cache) -> SharedRuns:
    """A multi-process run that several tests check, or compare with, launched once (SharedRuns)."""
    return SharedRuns(tmp_path_factory, data_cache)


# The run the fault tests (preemption, restart) interrupt, and compare with uninterrupted (shared_run).
FAULT_RUN = ("--max_steps", "24", "--batch_size", "8")


def summary(output_dir) -> dict:
    return next(r for r in read_metrics(output_dir) if r["type"] == "summary")


def evals(output_dir) -> list[dict]:
    return [r for r in read_metrics(output_dir) if r["type"] == "eval"]


def assert_same_evals(a, b, tol: float = 1e-5, samples: int = 1000) -> None:
    """The same evaluations, each of `samples` validation samples (1000: all of the addition set's)."""
    ea, eb = evals(a), evals(b)
    assert [r["step"] for r in ea] == [r["step"] for r in eb] and ea
    for x, y in zip(ea, eb, strict=True):
        assert x["num_samples"] == y["num_samples"] == samples
        assert abs(x["eval_loss"] - y["eval_loss"]) < tol and x["exact_match"] == y["exact_match"], (x, y)


def assert_matches_reference(ref, out, steps) -> None:
    """Same train losses (within 1e-5) at `steps` and same evaluations as the reference run."""
    assert_same_losses(train_losses(ref), train_losses(out), steps, tol=1e-5)
    assert_same_evals(ref, out)


def assert_layout(output_dir, **degrees) -> None:
    """The run really used the layout (not N silent copies of one process)."""
    layouts = [r["layout"] for r in read_metrics(output_dir) if r["type"] == "train"]
    assert layouts and all(all(layout[k] == v for k, v in degrees.items()) for layout in layouts), layouts[:1]


def resume_matches(
    script: str,
    flags: list[str],
    nproc: int,
    out: Path,
    straight: Path,
    resume_script: str | None = None,
    resume_flags: list[str] | None = None,
    resume_nproc: int | None = None,
    stop: int = 10,
    tol: float = 1e-6,
) -> None:
    """Stop a run at `stop` with a checkpoint, continue it (possibly under another script/layout),
    and check the continued steps against the uninterrupted run `straight`."""
    launch(
        script,
        [*flags, "--output_dir", str(out), "--stop_at_step", str(stop), "--checkpoint_every", str(stop)],
        nproc=nproc,
    )
    assert (out / "checkpoints" / f"step_{stop}").is_dir() and not (out / "model").exists()
    launch(
        resume_script or script,
        [*(resume_flags or flags), "--output_dir", str(out), "--resume_from_checkpoint", "latest"],
        nproc=resume_nproc or nproc,
    )
    a, b = train_losses(straight), train_losses(out)
    last = max(a)
    assert sorted(b) == list(range(1, last + 1)), "the resumed run must append its steps to the same metrics.jsonl"
    assert_same_losses(a, b, list(range(stop + 1, last + 1)), tol=tol)
    assert (out / "model" / "model.safetensors").is_file()


def evaluate_matches_in_run_eval(run_dir: Path, tmp_path: Path, batch_size: str = "64") -> None:
    """scripts/evaluate.py on one process reproduces the run's final in-run evaluation."""
    import json as _json

    out = tmp_path / "eval.json"
    launch(
        "evaluate.py", ["--model_dir", str(run_dir / "model"), "--batch_size", batch_size, "--output_file", str(out)]
    )
    result, final = _json.loads(out.read_text()), evals(run_dir)[-1]
    assert result["num_samples"] == final["num_samples"] == 1000
    assert abs(result["eval_loss"] - final["eval_loss"]) < 1e-5 and result["exact_match"] == final["exact_match"]


def resume_and_evaluate(script: str, flags: list[str], tmp_path: Path, straight: Path) -> None:
    """On 2 processes: a run stopped at step 10 and resumed matches the straight run (`straight`, the
    same flags uninterrupted) within 1e-6, and evaluate.py on one process reproduces the resumed
    run's final evaluation."""
    resume_matches(script, flags, 2, tmp_path / "resumed", straight, tol=1e-6)
    evaluate_matches_in_run_eval(tmp_path / "resumed", tmp_path)
