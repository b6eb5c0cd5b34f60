"""The state of this process's run, read without any collective: where the run stands, for the lines of a
run that fails (common/faults.py names the step a peer was lost at) and for the cut check's run on a
shrunken copy (common/shrunk.py); and what the run's end releases (launch.end_process_groups)."""

from __future__ import annotations


class RunPosition:
    """Where the run stands (StepFeed sets it): run_main names it when a peer froze or died."""

    step: int | None = None  # the optimizer step being run (1-based); None before the first
    finished: bool = False  # past the last step (export, summary)
    waiting: str | None = None  # a collective waited for outside torch's own frames (an async work)
    collective_timeout: float | None = None  # seconds, from --collective_timeout
    output_dir: str | None = None  # where a rank that crashes keeps its traceback (logs/)
    started: float = 0.0  # time.time() at set-up: a kept traceback older than that is another run's
    shrunken_copy: str | None = None  # while common/shrunk.py runs the script up to its cut check: its words

    @classmethod
    def describe(cls) -> str:
        if cls.step is None:
            return "set-up"
        return f"after step {cls.step}" if cls.finished else f"step {cls.step}"


# What end_process_groups calls once the process group is gone: common/layout.py adds the release of its
# device meshes' groups, so that a run without a mesh carries none of it; common/output_checks.py the
# release of the run's lock on its --output_dir.
RELEASE_AT_END: list = []
