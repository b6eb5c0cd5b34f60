"""One-line errors for bad input, the early exit that is not one, where the run stands, and what its end
releases (a module every other imports, importing none of them)."""

from __future__ import annotations

import sys


class UsageError(Exception):
    """Bad input: reported as one line naming the flag and the fix, exit code 2."""


class NothingToDo(Exception):
    """Nothing left to do (resuming a finished run): one line, exit code 0, nothing written."""


class RunPosition:
    """Where the run stands (StepFeed sets it): run_main names it when a peer froze or died."""

    step: int | None = None  # the optimizer step being run (1-based); None before the first
    finished: bool = False  # past the last step (export, summary)
    waiting: str | None = None  # a collective waited for outside torch's own frames (an async work)
    collective_timeout: float | None = None  # seconds, from --collective_timeout
    output_dir: str | None = None  # where a rank that crashes keeps its traceback (logs/)
    started: float = 0.0  # time.time() at set-up: a kept traceback older than that is another run's

    @classmethod
    def describe(cls) -> str:
        if cls.step is None:
            return "set-up"
        return f"after step {cls.step}" if cls.finished else f"step {cls.step}"


# What end_process_groups calls once the process group is gone: common/layout.py adds the release of
# its device meshes' groups, so that a run without a mesh carries none of it; common/checkpoint.py the
# release of the run's lock on its --output_dir.
RELEASE_AT_END: list = []


def off_the_bar() -> str:
    """A newline where a progress bar is drawn (it ends in none): the error line then starts a line of its own."""
    bars = sys.modules.get("tqdm") and getattr(sys.modules["tqdm"].tqdm, "_instances", None)
    return "\n" if bars and any(not getattr(bar, "disable", True) for bar in list(bars)) else ""
