"""One-line errors for bad input, and the one early exit that is not an error."""


class UsageError(Exception):
    """Bad input: reported as one line naming the flag and the fix, exit code 2."""


class NothingToDo(Exception):
    """The run has nothing left to do (e.g. resuming a finished run): one line, exit code 0,
    nothing written."""
