"""One-line errors for bad input."""


class UsageError(Exception):
    """Bad input: reported as one line naming the flag and the fix, exit code 2."""
