"""One-line errors for bad input, the one early exit that is not an error, and where the run
stands (for the one line that a lost peer ends a run with)."""


class UsageError(Exception):
    """Bad input: reported as one line naming the flag and the fix, exit code 2."""


class NothingToDo(Exception):
    """The run has nothing left to do (e.g. resuming a finished run): one line, exit code 0,
    nothing written."""


class RunPosition:
    """Where the run stands: the training loop's data stream (StepFeed) sets the optimizer
    step it hands out; `launch.run_main` names it when a collective fails because a peer froze
    or died. One per process, module level: the failure surfaces far from the loop."""

    step: int | None = None  # the optimizer step being run (1-based); None before the first
    finished: bool = False  # past the last step (export, summary)
    waiting: str | None = None  # a collective waited for outside torch's own frames (an async work)
    collective_timeout: float | None = None  # seconds, from --collective_timeout

    @classmethod
    def describe(cls) -> str:
        if cls.step is None:
            return "set-up"
        return f"after step {cls.step}" if cls.finished else f"step {cls.step}"
