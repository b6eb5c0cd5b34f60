"""The documentation keeps its promises: every flag shown in a command exists, every link leads
to a file, the README stays short, and nothing points to a file outside the repository.

A "command" is a fenced-code line (lines ending in a backslash are joined) or an inline code
span that runs `scripts/<name>.py`: `python scripts/<name>.py ...`, `accelerate launch ...
scripts/<name>.py ...`, `torchrun ... scripts/<name>.py ...`, or a span that starts with the
script. Flags before the script belong to the launcher and are not checked; flags after it must
appear in `python scripts/<name>.py --help`.
"""

from __future__ import annotations

import functools
import re
import shlex
import subprocess
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import unquote

import pytest

from conftest import run_refused

# one xdist worker runs these tests: every script's --help is run once (all_help), not once per worker
pytestmark = pytest.mark.xdist_group("docs")

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
ZH = DOCS / "zh"  # the Chinese edition: its pages may not exist yet
README_MAX_LINES = 250

# Built from pieces so that this file does not contain what it looks for.
FORBIDDEN = (".." + "/shared", "CONVEN" + "TIONS", "pit" + "fall ")
SCANNED_TOP = ("README.md", "docs", "scripts", "tests", "benchmarks", "data", "accelerate_configs")

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`([^`\n]+)`")
SCRIPT = re.compile(r"^(?:\./)?scripts/([A-Za-z_]\w*)\.py$")
RUNNERS = {"python", "python3", "torchrun", "accelerate", "launch", "..."}
SEPARATORS = {"&&", "||", ";", "|"}


def doc_files() -> list[Path]:
    """README.md and every page under docs/, the Chinese ones included when they exist."""
    return [README, *sorted(DOCS.rglob("*.md"))] if DOCS.is_dir() else [README]


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


# ----------------------------------------------------------------------------- commands and flags
def code_lines(text: str):
    """(line number, text) of every fenced-code line and every inline code span."""
    in_fence, pending = False, None
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            in_fence, pending = not in_fence, None
            continue
        if not in_fence:
            for span in INLINE_CODE.findall(line):
                yield number, span
            continue
        if pending:  # the continuation of a line that ended with a backslash
            number, line = pending[0], pending[1] + " " + line.strip()
        if line.rstrip().endswith("\\"):
            pending = (number, line.rstrip()[:-1])
            continue
        pending = None
        yield number, line


def tokens_of(line: str) -> list[str]:
    try:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = ""
        return list(lexer)
    except ValueError:  # unbalanced quotes in prose: a plain split is good enough
        return line.split()


def script_runs(line: str):
    """(script name, flags after the script) for each command in the line that runs a script."""
    segment: list[str] = []
    for token in [*tokens_of(line), ";"]:
        if token.startswith("#"):  # a shell comment ends the command
            token = ";"
        if token not in SEPARATORS and not set(token) <= set(";&|"):
            segment.append(token)
            continue
        for i, word in enumerate(segment):
            match = SCRIPT.match(word)
            if not match:
                continue
            before = [w for w in segment[:i] if "=" not in w or w.startswith("-")]  # FOO=bar: environment
            runs = not before or before[0].split("/")[-1] in RUNNERS
            if runs:
                flags = []
                for w in segment[i + 1 :]:
                    w = w.strip("[](),.")
                    if w.startswith("--") and len(w) > 2:
                        flags.append(w.split("=", 1)[0])
                yield match.group(1), flags
            break
        segment = []


def documented_commands() -> list[tuple[str, int, str, list[str]]]:
    """(file, line, script name, flags) of every command in README.md and docs/."""
    found = []
    for path in doc_files():
        for number, line in code_lines(path.read_text(encoding="utf-8")):
            for name, flags in script_runs(line):
                found.append((rel(path), number, name, flags))
    return found


@functools.lru_cache(maxsize=None)
def all_help() -> dict[str, SimpleNamespace]:
    """`python scripts/<name>.py --help` of every documented script, once each, all in one interpreter
    (torch is imported once)."""
    names = sorted({name for _, _, name, _ in COMMANDS if (REPO / "scripts" / f"{name}.py").is_file()})
    return dict(zip(names, run_refused([(f"{name}.py", ["--help"]) for name in names]), strict=True))


def help_text(name: str) -> str:
    result = all_help()[name]
    assert result.returncode == 0, f"scripts/{name}.py --help failed:\n{result.stderr[-2000:]}"
    return result.stdout


COMMANDS = documented_commands()


def test_the_docs_show_commands():
    assert any(file == "README.md" for file, *_ in COMMANDS), "no command that runs a script found in README.md"
    assert {name for *_, name, _ in COMMANDS} >= {"train_ddp", "evaluate"}


@pytest.mark.parametrize("name", sorted({name for _, _, name, _ in COMMANDS}))
def test_every_flag_in_a_command_exists(name):
    where = [(file, number) for file, number, n, _ in COMMANDS if n == name]
    assert (REPO / "scripts" / f"{name}.py").is_file(), f"scripts/{name}.py does not exist, but is run at {where}"
    options = set(re.findall(r"(?<![\w-])(--[A-Za-z][\w-]*)", help_text(name)))
    missing = [
        f"{file}:{number}: {flag}"
        for file, number, n, flags in COMMANDS
        if n == name
        for flag in flags
        if flag not in options
    ]
    assert not missing, f"flags not in `python scripts/{name}.py --help`:\n" + "\n".join(missing)


# ----------------------------------------------------------------------------- links
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def prose(text: str) -> str:
    """The text without code (fenced blocks and inline spans), where links are not links."""
    kept, in_fence = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            kept.append(INLINE_CODE.sub("", line))
    return "\n".join(kept)


def relative_links(path: Path) -> list[str]:
    text = prose(path.read_text(encoding="utf-8"))
    targets = LINK.findall(text) + REFERENCE.findall(text)
    return [t for t in targets if not SCHEME.match(t) and not t.startswith("#")]


@pytest.mark.parametrize("path", doc_files(), ids=rel)
def test_relative_links_lead_to_files_in_the_repository(path):
    broken = []
    for target in relative_links(path):
        file_part = unquote(target.split("#", 1)[0].split("?", 1)[0])
        resolved = (path.parent / file_part).resolve()
        if resolved != REPO and REPO not in resolved.parents:
            broken.append(f"{target} (outside the repository)")
        elif not resolved.exists():
            if ZH in (resolved, *resolved.parents) and not ZH.is_dir():
                continue  # the Chinese edition is still being written
            broken.append(target)
    assert not broken, f"{rel(path)}: links to missing files: {broken}"


# ----------------------------------------------------------------------------- size and self-containment
def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines; move detail to docs/ (at most {README_MAX_LINES})"
    )


def repository_files() -> list[Path]:
    """Tracked and untracked-but-not-ignored files (no caches, no virtual environment)."""
    try:
        listing = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO,
            capture_output=True,
            check=True,
        ).stdout.decode()
        paths = [REPO / p for p in listing.split("\0") if p]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout
        skip = {".git", ".venv", "cache", "__pycache__", ".pytest_cache", "runs"}
        paths = [p for p in REPO.rglob("*") if not skip & set(p.relative_to(REPO).parts)]
    return [p for p in paths if p.is_file() and p.relative_to(REPO).parts[0] in SCANNED_TOP]


def test_nothing_refers_to_files_outside_the_repository():
    hits = []
    for path in repository_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):  # images and other binary files
            continue
        for number, line in enumerate(text.splitlines(), 1):
            for word in FORBIDDEN:
                found = word.lower() in line.lower() if word == FORBIDDEN[2] else word in line  # any case for the third
                if found:
                    hits.append(f"{rel(path)}:{number}: {word!r}")
    assert not hits, "references to files that are not in the repository:\n" + "\n".join(hits)


@pytest.mark.parametrize("name", ["train_ddp", "train_fsdp", "train_tp", "train_pp", "train_hybrid", "train_localsgd"])
def test_help_states_each_default_once(name):
    """No "(None: ...) (default: None)": a default is shown once, and None is never shown as one."""
    text = help_text(name)
    assert "(default: None)" not in text and "(None:" not in text
    assert "(default: False)" not in text  # switches are off unless given
