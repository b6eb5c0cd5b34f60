"""What a run measures and writes: metrics.jsonl and the progress bar (RunMonitor), the cadence of
records, evaluations and checkpoints. Throughput and MFU: common/throughput.py; the first lines:
common/banner.py."""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .banner import start_lines
from .errors import UsageError
from .throughput import Throughput, peak_flops, synchronize


class MetricsWriter:  # metrics.jsonl, one JSON object a line, from the main process
    def __init__(self, output_dir, enabled: bool):
        self.enabled, self.path = enabled, Path(output_dir) / "metrics.jsonl"
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        line = (json.dumps(record) + "\n").encode()
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)  # a resumed run appends
            try:
                start = os.lseek(fd, 0, os.SEEK_END)
                try:
                    written = 0
                    while written < len(line):  # a full disk may take part of it first
                        written += os.write(fd, line[written:])
                except OSError:
                    os.ftruncate(fd, start)  # no half record: a resumed run appends after whole lines
                    raise
            finally:
                os.close(fd)
        except OSError as e:  # a full disk: one line (the folder was found writable before step 1)
            raise UsageError(
                f"{self.path} could not be written ({e.strerror or type(e).__name__}): free space there, then "
                "continue with --resume_from_checkpoint latest"
            ) from None


class RunMonitor:
    """Watches the run for the training loop: its cadence (which steps log, evaluate, checkpoint), the
    step timers and throughput, metrics.jsonl, Accelerate's trackers, the progress bar. It runs no
    training: the loop stays in the script."""

    def __init__(self, accelerator, args, name: str, feed, world_size: int, global_batch_size: int):
        start_step = feed.step
        self.accelerator, self.args, self.name, self.start_step, self.feed = accelerator, args, name, start_step, feed
        self.world_size, self.global_batch_size = world_size, global_batch_size
        self.metrics = MetricsWriter(args.output_dir, accelerator.is_main_process)
        config = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))}
        accelerator.init_trackers(name, config=config)  # Accelerate: trackers (--report_to)
        self.bar = self.layout = self.throughput = None  # start() makes them
        self.first_step_collectives = None  # collectives() fills it; the summary reports it
        self._logged, self.run_start = False, time.perf_counter()
        self.step, self._stretch_start = start_step, None

    def start(
        self, task, model_line: str, n_params: int, data, strategy_lines: list[str], resume_path=None, layout=None
    ) -> None:
        """Print the run's first lines (common/banner.py), then open the progress bar."""
        acc, args = self.accelerator, self.args
        self.layout = layout
        tokens = task.tokens_per_sample
        self.tokens_per_step = self.global_batch_size * (tokens or 1)
        self.unit = "tokens" if tokens else "samples"
        self.throughput = Throughput(task.flops_per_item(n_params), peak_flops(acc.device, args.peak_flops), self.unit)
        acc.print(start_lines(self, task, model_line, data, strategy_lines, resume_path))  # Accelerate: main only
        # main process only; to a log file (no terminal) a redraw every 30 s, not every step
        shown = {"disable": not acc.is_main_process, "mininterval": 0.1 if sys.stderr.isatty() else 30}
        self.bar = tqdm(total=args.max_steps, initial=self.start_step, desc="train", dynamic_ncols=True, **shown)

    # --- when: the cadence flags ----------------------------------------------------------
    def due(self, step: int, what: str) -> bool:
        """Is a "train" record, an "eval" or a "checkpoint" due after `step`?"""
        a, last = self.args, step == self.args.max_steps
        if what == "train":
            return step % a.log_every == 0 or last
        if what == "eval":
            return bool(a.eval_every and step % a.eval_every == 0) or last
        return bool(a.checkpoint_every and step % a.checkpoint_every == 0) or step == a.stop_at_step

    def collectives(self):
        """Counts the collectives of the run's first step for the summary (common/collectives.py)."""
        from .collectives import count_first_step  # the sharded scripts' (and Local SGD's)

        return count_first_step(self)

    # --- what -------------------------------------------------------------------------------
    # Training time is measured over stretches of steps between two device synchronisations (a GPU's
    # host runs ahead of its kernels: docs/troubleshooting.md, "Throughput timers on a GPU"). A stretch
    # ends before a record, an evaluation or a checkpoint, so those never count.
    @contextmanager
    def timed_step(self):
        """One optimizer step of the loop, timed as training."""
        if self._stretch_start is None:
            synchronize(self.accelerator.device)
            self._stretch_start = time.perf_counter()
        yield
        self.step += 1
        self.throughput.add(self.tokens_per_step, 0.0)
        step = self.step
        if self.step == self.start_step + 1 and self.args.compile:
            self._end_stretch()
            self.write(f"step {step} took {self.throughput.total[1]:.1f} s, torch.compile's compilation included")
        elif any(self.due(step, what) for what in ("train", "eval", "checkpoint")):
            self._end_stretch()
        self.bar.update(1)

    def _end_stretch(self) -> None:
        if self._stretch_start is not None:
            synchronize(self.accelerator.device)
            self.throughput.add(0, time.perf_counter() - self._stretch_start)
            self._stretch_start = None

    def train(self, step: int, loss: float, lr: float, grad_norm, **extra) -> dict:
        """One train record; `grad_norm` is None when --max_grad_norm 0 turned clipping off."""
        grad_norm = None if grad_norm is None or not self.args.max_grad_norm else float(grad_norm)
        layout = {"layout": self.layout.describe()} if self.layout is not None else {}
        # The first record after a resume says so: the later record of a step logged twice counts.
        resumed = {"resumed": True} if self.start_step > 0 and not self._logged else {}
        self._logged = True
        record = {"type": "train", "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm}
        record |= {"global_batch_size": self.global_batch_size, "world_size": self.world_size, "epoch": self.feed.epoch}
        record |= {**self.clock(), **layout, **resumed, **extra}  # plot any run against time
        record |= self.throughput.report(self.world_size)
        self.metrics.write(record)
        self.accelerator.log({k: v for k, v in record.items() if isinstance(v, float)}, step=step)  # Accelerate
        per_sec = f"{record[f'{self.unit}_per_sec']:.0f}"
        self.bar.set_postfix({"loss": f"{loss:.4f}", "tok_s" if self.unit == "tokens" else "samples_s": per_sec})
        return record

    def eval(self, step: int, result: dict, **extra) -> None:
        self.metrics.write({"type": "eval", "step": step, **extra, **result, **self.clock()})
        self.accelerator.log({k: v for k, v in result.items() if k != "num_samples"}, step=step)
        figures = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items())
        self.write(f"step {step}: {figures}")  # 4 digits; metrics.jsonl keeps them all

    def write(self, line: str) -> None:
        """A line above the bar, from the main process."""
        if self.accelerator.is_main_process:
            self.bar.write(line)

    def clock(self) -> dict:  # seconds since the start, and training seconds (the steps alone) so far
        elapsed, trained = time.perf_counter() - self.run_start, self.throughput.total[1]
        return {"elapsed_s": round(elapsed, 2), "train_s": round(trained, 2)}

    def summary(self, step: int, preempted: bool = False, **figures) -> dict:
        """The run's last record; prints it with where the model (or the checkpoint) is."""
        self._end_stretch()  # a preempted run stops after any step
        self.bar.close()
        if preempted:
            figures["preempted"] = True
        if self.first_step_collectives is not None:  # counted by collectives()
            figures["collectives_first_step_rank0"] = self.first_step_collectives
        if self.args.compile:  # how many graphs torch.compile made (0: it compiled nothing)
            figures["compiled_graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        summary = {"type": "summary", "steps": step - self.start_step, "final_step": step}
        summary |= {"time_s": self.clock()["elapsed_s"], **self.throughput.summary(self.world_size)}
        summary |= {"global_batch_size": self.global_batch_size, "world_size": self.world_size, **figures}
        self.metrics.write(summary)
        if step == self.args.max_steps and getattr(self.args, "lora_r", 0):
            merged = f", the merged model to {Path(self.args.output_dir) / 'model'}" if self.args.merge_lora else ""
            saved = f"adapter saved to {Path(self.args.output_dir) / 'adapter'}{merged}"
        elif step == self.args.max_steps:
            saved = f"model saved to {Path(self.args.output_dir) / 'model'}"
        elif preempted:
            saved = f"preempted at step {step}: resume with --resume_from_checkpoint auto"
        else:
            saved = f"stopped at step {step}: continue with --resume_from_checkpoint latest"
        self.accelerator.print(f"done: {summary}\n{saved}; metrics in {self.metrics.path}")
        return summary
