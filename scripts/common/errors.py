"""One-line errors for bad input, the early exit that is not one, and where the run stands."""


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
