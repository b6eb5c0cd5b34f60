"""One-line errors for bad input, and the early exit that is not one (a module every other imports,
importing none of them)."""

from __future__ import annotations

import sys


class UsageError(Exception):
    """Bad input: reported as one line naming the flag and the fix, exit code 2."""


class NothingToDo(Exception):
    """Nothing left to do (resuming a finished run): one line, exit code 0, nothing written."""


def off_the_bar() -> str:
    """A newline where a progress bar is drawn (it ends in none): the error line then starts a line of its own."""
    bars = sys.modules.get("tqdm") and getattr(sys.modules["tqdm"].tqdm, "_instances", None)
    return "\n" if bars and any(not getattr(bar, "disable", True) for bar in list(bars)) else ""
