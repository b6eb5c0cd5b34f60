"""docs/accelerate_config.md: the answers it gives to `accelerate config` on a CPU-only machine write
a config under which `accelerate launch` starts 2 processes of ONE run.

Drives the real `accelerate config` in a pseudo-terminal: every prompt of the page must appear, in
its order, and gets the page's answer (menus by the keys a person presses: arrows, Enter)."""

import re
import sys

import pexpect
import yaml

from conftest import SCRIPTS, TINY, free_port, job_env, read_metrics, run_cmd

DOWN, ENTER = "\x1b[B", "\r"  # what the ↓ and Enter keys send
# A menu hides the cursor once drawn, reads keys, prints the choice and shows the cursor again. It reads
# each key in raw mode set with TCSAFLUSH, which drops keys that came before it was ready: hence the wait.
HIDE_CURSOR, SHOW_CURSOR = "\x1b[?25l", "\x1b[?25h"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")

# (prompt, keys, the choice a menu prints, or None for a typed answer): the table of
# docs/accelerate_config.md, accelerate 1.15, in order
ANSWERS = [
    ("In which compute environment are you running?", ENTER, "This machine"),
    ("Which type of machine are you using?", DOWN * 4 + ENTER, "multi-GPU"),
    ("How many different machines will you use (use more than 1 for multi-node training)? [1]:", "1\r", None),
    (
        "Should distributed operations be checked while running for errors? This can avoid timeout issues but will"
        " be slower. [yes/NO]:",
        "no\r",
        None,
    ),
    ("Do you wish to optimize your script with torch dynamo?[yes/NO]:", "no\r", None),
    ("Do you want to use DeepSpeed? [yes/NO]:", "no\r", None),
    ("Do you want to use FullyShardedDataParallel? [yes/NO]:", "no\r", None),
    ("Do you want to use Megatron-LM ? [yes/NO]:", "no\r", None),
    ("How many GPU(s) should be used for distributed training? [1]:", "2\r", None),
    (
        "What GPU(s) (by id) should be used for training on this machine as a comma-separated list? [all]:",
        "all\r",
        None,
    ),
    (
        "Would you like to enable numa efficiency? (Currently only supported on NVIDIA hardware). [yes/NO]:",
        "no\r",
        None,
    ),
    ("Do you wish to use mixed precision?", ENTER, "no"),
]


def choose(child, keys: str, choice: str) -> None:
    """Answer a menu: wait until it reads keys, press them, check what it printed as chosen."""
    child.expect_exact(HIDE_CURSOR)
    child.send(keys)  # pexpect waits 50 ms before sending: the menu is reading by then
    if child.expect_exact([SHOW_CURSOR, pexpect.TIMEOUT], timeout=10) == 1:  # dropped after all: once more
        child.send(keys)
        child.expect_exact(SHOW_CURSOR)
    printed = ANSI.sub("", child.before).rstrip().rsplit("\r", 1)[-1].strip()
    assert printed == choice, f"the menu chose {printed!r}, the page says {choice!r}"


def write_config(path) -> None:
    """Answer `accelerate config --config_file path` as the page says."""
    cmd = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "config", "--config_file", str(path)]
    child = pexpect.spawn(cmd[0], cmd[1:], env=job_env(), encoding="utf-8", timeout=60, dimensions=(40, 200))
    try:
        for prompt, keys, choice in ANSWERS:
            child.expect_exact(prompt)
            if choice is None:
                child.send(keys)
            else:
                choose(child, keys, choice)
        child.expect_exact(f"accelerate configuration saved at {path}")
        child.expect_exact(pexpect.EOF)
    except (pexpect.TIMEOUT, pexpect.EOF) as e:
        seen = ANSI.sub("", child.before or "")[-2000:]
        raise AssertionError(
            f"accelerate config went another way than the page ({type(e).__name__}):\n{seen}"
        ) from None
    finally:
        child.close()
    assert child.exitstatus == 0, child.exitstatus


def test_documented_answers_start_two_processes_of_one_run(tmp_path, data_cache):
    config = tmp_path / "cfg.yaml"
    write_config(config)
    settings = yaml.safe_load(config.read_text())
    assert settings["distributed_type"] == "MULTI_GPU" and settings["num_processes"] == 2, settings
    assert settings["mixed_precision"] == "no" and settings["num_machines"] == 1, settings

    out = tmp_path / "run"
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    flags = [*TINY, "--max_steps", "3", "--eval_every", "0", "--data_cache_dir", data_cache, "--output_dir", str(out)]
    flags += ["--addition_digits", "2"]  # 10k problems: built in a moment where the session's cache lacks them
    port = ["--main_process_port", str(free_port())]
    result = run_cmd([*launcher, *port, str(SCRIPTS / "train_ddp.py"), *flags], timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("train_ddp: ") == 1, "two separate runs instead of 2 processes of one"
    sizes = {r["world_size"] for r in read_metrics(out) if "world_size" in r}
    assert sizes == {2}, sizes
