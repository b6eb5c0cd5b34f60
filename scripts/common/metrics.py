"""What a run measures and writes: metrics.jsonl and the progress bar (RunMonitor), throughput,
MFU, peak memory, evaluation (replicated or sharded model), and the cost figures of the sharded
strategies (bytes each rank holds, collectives of one step)."""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, Subset
from tqdm.auto import tqdm

from .task import first

# Dense bf16 peak FLOP/s of common accelerators, for MFU; CPUs have no reliable figure (use --peak_flops).
PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
    "L4": 121e12,
    "V100": 125e12,
    "T4": 65e12,
}


def peak_flops(device: torch.device, override: float | None) -> float | None:
    if override:
        return override
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((v for k, v in PEAK_FLOPS.items() if k in name), None)
    return None


def peak_memory_mb(device: torch.device) -> float:
    """Peak accelerator memory allocated on CUDA; peak resident memory of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ring_allreduce_bytes(n_bytes: float, n_ranks: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce: reduce-scatter then all-gather,
    each moving (N-1)/N of the buffer."""
    return 2 * (n_ranks - 1) / n_ranks * n_bytes


class MetricsWriter:
    """metrics.jsonl, one JSON object a line, written by the main process only."""

    def __init__(self, output_dir, enabled: bool):
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as f:  # append: a resumed run continues the same file
                f.write(json.dumps(record) + "\n")


class Throughput:
    """Tokens/s (samples/s where samples have no tokens) and MFU over training-step time only
    (evaluation and checkpoints excluded): per report window, and over the whole run."""

    def __init__(self, flops_per_item: float | None, peak: float | None, unit: str = "tokens"):
        self.flops_per_item, self.peak, self.unit = flops_per_item, peak, unit
        self.window = [0, 0.0]  # tokens, seconds since the last report
        self.total = [0, 0.0]

    def add(self, tokens: int, seconds: float) -> None:
        for acc in (self.window, self.total):
            acc[0] += tokens
            acc[1] += seconds

    def _figures(self, items: int, seconds: float, world_size: int) -> dict:
        per_sec = items / max(seconds, 1e-9)
        known = self.peak and self.flops_per_item
        mfu = per_sec * self.flops_per_item / (self.peak * world_size) if known else None
        return {f"{self.unit}_per_sec": round(per_sec, 1), "mfu": None if mfu is None else round(mfu, 4)}

    def report(self, world_size: int) -> dict:
        figures = self._figures(*self.window, world_size)
        self.window = [0, 0.0]
        return figures

    def summary(self, world_size: int) -> dict:
        return {**self._figures(*self.total, world_size), "train_time_s": round(self.total[1], 2)}


class RunMonitor:
    """Watches the run for the training loop, in one place: its cadence (which steps log, evaluate,
    checkpoint), the step timers and throughput over training-step time, the first step's
    collectives, the records of metrics.jsonl (main process), the same figures to Accelerate's
    trackers, and the progress bar. It runs no training: the loop stays in the script.

    Without a terminal (a log file, a batch job) the bar redraws at most every 30 s instead of
    filling the log with carriage returns."""

    def __init__(self, accelerator, args, name: str, start_step: int, world_size: int, global_batch_size: int):
        self.accelerator, self.args, self.name, self.start_step = accelerator, args, name, start_step
        self.world_size, self.global_batch_size = world_size, global_batch_size
        self.metrics = MetricsWriter(args.output_dir, accelerator.is_main_process)
        config = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))}
        accelerator.init_trackers(name, config=config)  # Accelerate: trackers (--report_to)
        self.bar = self.layout = self.throughput = None  # start() makes them
        self.first_step_collectives = None  # collectives() fills it; the summary reports it
        self._logged = False
        self.run_start = time.perf_counter()
        self.step, self._stretch_start = start_step, None

    def start(
        self, task, model_line: str, n_params: int, data, strategy_lines: list[str], resume_path=None, layout=None
    ) -> None:
        """Print the run's first lines (who runs, the model (`model_line`: Task.describe), the data, the
        global batch, what the strategy costs, where a resumed run starts), then open the progress bar.
        Throughput counts tokens where the task's samples have them (Task.tokens_per_sample), else samples."""
        acc, args = self.accelerator, self.args
        self.layout = layout
        tokens = task.tokens_per_sample
        self.tokens_per_step = self.global_batch_size * (tokens or 1)
        self.unit = "tokens" if tokens else "samples"
        self.throughput = Throughput(task.flops_per_item(n_params), peak_flops(acc.device, args.peak_flops), self.unit)
        of_tokens = f" of {tokens} tokens" if tokens else ""
        dp = self.global_batch_size // (args.batch_size * args.gradient_accumulation_steps)
        lines = [
            f"{self.name}: {self.world_size} process(es) on {acc.device} ({acc.distributed_type}), "
            f"mixed precision {acc.mixed_precision}"
        ]
        if layout is not None:
            lines.append(layout.table())
        lines += [
            f"  {model_line}",
            f"  data {getattr(data, 'name', 'data')}: {len(data.train)} train / "
            f"{len(data.validation)} validation samples{of_tokens}",
            f"  global batch = {args.batch_size} per data-parallel rank x {dp} dp ranks "
            f"x {args.gradient_accumulation_steps} accumulation = {self.global_batch_size} samples",
            *(f"  {line}" for line in strategy_lines),
        ]
        if resume_path:
            lines.append(f"  resuming from {resume_path} at step {self.start_step}")
        acc.print("\n".join(lines))  # Accelerate: prints on the main process only
        mininterval = 0.1 if sys.stderr.isatty() else 30
        self.bar = tqdm(
            total=args.max_steps,
            initial=self.start_step,
            desc="train",
            dynamic_ncols=True,
            disable=not acc.is_main_process,
            mininterval=mininterval,
        )

    # --- when: the cadence flags ----------------------------------------------------------
    def due(self, step: int, what: str) -> bool:
        """Is a "train" record, an "eval" or a "checkpoint" due after `step`?"""
        return {"train": self.is_log_step, "eval": self.is_eval_step, "checkpoint": self.is_checkpoint_step}[what](step)

    @contextmanager
    def collectives(self):
        """Counts the collectives of the run's first step (forward and backward, every kind) for the
        summary; later steps run without the counter, and so does --compile (a dispatch mode stops it)."""
        first = self.step == self.start_step and not self.args.compile
        if self.first_step_collectives is None:
            self.first_step_collectives = {}  # stays empty under --compile
        with CollectiveCounter(enabled=first) as counter:
            yield
        if first:
            self.first_step_collectives = counter.report()
            collectives = ", ".join(f"{k} {v['calls']} calls / {v['mib']:.3f} MiB" for k, v in counter.report().items())
            self.write(f"  collectives of the first step (rank 0): {collectives or 'none'}")

    def is_log_step(self, step: int) -> bool:
        return step % self.args.log_every == 0 or step == self.args.max_steps

    def is_eval_step(self, step: int) -> bool:
        return bool(self.args.eval_every and step % self.args.eval_every == 0) or step == self.args.max_steps

    def is_checkpoint_step(self, step: int) -> bool:
        return (
            bool(self.args.checkpoint_every and step % self.args.checkpoint_every == 0)
            or step == self.args.stop_at_step
        )

    # --- what -------------------------------------------------------------------------------
    # Training time is measured over stretches of consecutive steps, each between two device
    # synchronisations: on a GPU the host runs ahead of the kernels, and a clock read per step
    # would count queued work in the next step, or in the evaluation after it
    # (docs/troubleshooting.md, "Throughput timers on a GPU"). A stretch ends before anything
    # that is not training (a record, an evaluation, a checkpoint, the end), so those never count.
    def step_start(self) -> None:
        if self._stretch_start is None:
            synchronize(self.accelerator.device)
            self._stretch_start = time.perf_counter()

    def step_end(self) -> None:
        self.step += 1
        self.throughput.add(self.tokens_per_step, 0.0)
        step = self.step
        if self.step == self.start_step + 1 and self.args.compile:
            self._end_stretch()
            self.write(f"step {step} took {self.throughput.total[1]:.1f} s, torch.compile's compilation included")
        elif self.is_log_step(step) or self.is_eval_step(step) or self.is_checkpoint_step(step):
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
        # The first record after a resume says so: steps after the checkpoint that an interrupted
        # run had already logged appear again; the later record of a step is the one that counts.
        resumed = {"resumed": True} if self.start_step > 0 and not self._logged else {}
        self._logged = True
        record = {
            "type": "train",
            "step": step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "global_batch_size": self.global_batch_size,
            "world_size": self.world_size,
            **layout,
            **resumed,
            **extra,
            **self.throughput.report(self.world_size),
        }
        self.metrics.write(record)
        self.accelerator.log(
            {k: v for k, v in record.items() if isinstance(v, float)}, step=step
        )  # Accelerate: trackers
        per_sec = record[f"{self.unit}_per_sec"]
        self.bar.set_postfix(
            {"loss": f"{loss:.4f}", "tok_s" if self.unit == "tokens" else "samples_s": f"{per_sec:.0f}"}
        )
        return record

    def eval(self, step: int, result: dict, **extra) -> None:
        self.metrics.write({"type": "eval", "step": step, **extra, **result, "elapsed_s": self.elapsed()})
        self.accelerator.log({k: v for k, v in result.items() if k != "num_samples"}, step=step)
        self.write(f"step {step}: " + ", ".join(f"{k} {format_number(v)}" for k, v in result.items()))

    def write(self, line: str) -> None:
        """A line above the bar, from the main process."""
        if self.accelerator.is_main_process:
            self.bar.write(line)

    def elapsed(self) -> float:
        return round(time.perf_counter() - self.run_start, 2)

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
        summary = {
            "type": "summary",
            "steps": step - self.start_step,
            "final_step": step,
            "time_s": self.elapsed(),
            **self.throughput.summary(self.world_size),
            "global_batch_size": self.global_batch_size,
            "world_size": self.world_size,
            **figures,
        }
        self.metrics.write(summary)
        if step == self.args.max_steps:
            saved = f"model saved to {Path(self.args.output_dir) / 'model'}"
        elif preempted:
            saved = f"preempted at step {step}: resume with --resume_from_checkpoint auto"
        else:
            saved = f"stopped at step {step}: continue with --resume_from_checkpoint latest"
        self.accelerator.print(f"done: {summary}\n{saved}; metrics in {self.metrics.path}")
        return summary


def format_number(value) -> str:
    """4 significant digits for printing (metrics.jsonl keeps full precision)."""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def gather_max(accelerator, value: float) -> float:
    return (
        accelerator.gather(torch.tensor([float(value)], device=accelerator.device)).max().item()
    )  # Accelerate: all-gather


# ====================================================================== evaluation
@torch.no_grad()
def evaluate(accelerator, model, task, validation, batch_size: int, layout=None, predict=None) -> dict:
    """The task's evaluation (Task.eval_sums, Task.eval_metrics) over every validation sample
    exactly once, under any layout, plus `num_samples`.

    Data-parallel rank r scores samples r, r + dp, ... (dp: the layout's, else every process);
    every rank runs the same number of batches, the last ones padded with repeats of its first
    sample, because FSDP and the pipeline need all ranks in each forward; the padding is cut off
    before scoring. `predict(*inputs)` (default: the model) returns the outputs where they exist
    (a pipeline's last stage) and None elsewhere; one rank per data-parallel replica
    (`layout.holds_loss`) adds its sums, so each sample counts once, not once per TP rank
    (docs/troubleshooting.md, "Evaluation counted once per TP rank")."""
    from accelerate.utils import send_to_device

    dp = layout.dp if layout is not None else accelerator.num_processes
    r = layout.dp_rank if layout is not None else accelerator.process_index
    counts = layout is None or layout.holds_loss
    predict = predict or model
    n = len(validation)
    n_batches = math.ceil(math.ceil(n / dp) / batch_size)
    mine = list(range(r, n, dp))
    indices = (mine + [mine[0]] * (n_batches * batch_size))[: n_batches * batch_size]
    was_training = model.training
    model.eval()
    sums: dict[str, float] = defaultdict(float)
    for i, batch in enumerate(DataLoader(Subset(validation, indices), batch_size=batch_size)):
        batch = send_to_device(batch, accelerator.device)
        with accelerator.autocast():  # Accelerate: autocast
            outputs = full_outputs(predict(*task.inputs(batch)))  # loss parallel: a collective, every TP rank
        real = min(batch_size, len(mine) - i * batch_size)  # the rest of the batch is padding
        if outputs is None or not counts or real <= 0:
            continue
        for key, value in task.eval_sums(first(outputs, real), first(task.targets(batch), real)).items():
            sums[key] += float(value)
        sums["samples"] += real
    model.train(was_training)
    if dist.is_initialized() and dist.get_world_size() > 1:
        every_rank = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank, dict(sums))  # a few numbers per rank, once per evaluation
        sums = defaultdict(float)
        for part in every_rank:
            for key, value in part.items():
                sums[key] += value
    metrics = {
        k: float(v) if isinstance(v, (int, float, torch.Tensor)) else v for k, v in task.eval_metrics(sums).items()
    }
    return {"eval_loss": metrics.pop("eval_loss", None), "num_samples": int(sums["samples"]), **metrics}


def full_outputs(outputs):
    """Outputs that are DTensors (vocabulary-sharded logits under loss parallel) as full tensors."""
    if isinstance(outputs, DTensor):
        return outputs.full_tensor()
    if isinstance(getattr(outputs, "logits", None), DTensor):  # a 🤗 output object
        outputs.logits = outputs.logits.full_tensor()
    return outputs


# ====================================================================== sharded models
def local_bytes(tensors) -> int:
    """Bytes this rank really holds: a DTensor counts its local shard only."""
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)


def training_state_bytes(model: nn.Module, optimizer) -> dict:
    """Exact per-rank bytes of parameters, gradients and optimizer state (after a step, when Adam's
    moments exist). A gradient is the same shard as its parameter: it is counted as such (between
    steps, zero_grad has freed it)."""
    opt = getattr(optimizer, "optimizer", optimizer)
    params = list(model.parameters())
    optim_tensors = [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    figures = {
        "param_bytes": local_bytes(params),
        "grad_bytes": local_bytes(p for p in params if p.requires_grad),
        "optimizer_bytes": local_bytes(optim_tensors),
    }
    figures["total_bytes"] = sum(figures.values())
    return figures


def ddp_state_bytes(n_params: int, optimizer_name: str) -> dict:
    """What DDP holds on every rank in fp32: parameters, gradients, and for AdamW two moments
    (plus a 4-byte step count per tensor, ignored here)."""
    optim = 8 * n_params if optimizer_name == "adamw" else 0
    return {
        "param_bytes": 4 * n_params,
        "grad_bytes": 4 * n_params,
        "optimizer_bytes": optim,
        "total_bytes": 8 * n_params + optim,
    }


def sharded_start_line(model, layout, n_params: int, optimizer_name: str, accelerator) -> str:
    """What each rank holds, printed at start beside DDP's figure. Collective (a gather)."""
    param_bytes = gather_max(accelerator, local_bytes(model.parameters()))
    per_state = 4 if optimizer_name == "adamw" else 2  # parameters, gradients (+ two Adam moments), fp32
    ddp_bytes = ddp_state_bytes(n_params, optimizer_name)["total_bytes"]
    return (
        f"parameters per rank (largest): {param_bytes / 2**20:.2f} MiB "
        f"of the unsharded {4 * n_params / 2**20:.2f} MiB; "
        f"with gradients and optimizer state ~{per_state * param_bytes / 2**20:.2f} MiB "
        f"(DDP: {ddp_bytes / 2**20:.2f} MiB, ideal split over {layout.model_split}: "
        f"{ddp_bytes / layout.model_split / 2**20:.2f} MiB)"
    )


def replicated_summary(accelerator, n_params: int, allreduce_mib: float) -> dict:
    """The cost figures of a replicated run's summary (DDP, Local SGD): peak memory of the largest
    rank and of all ranks, and the gradient all-reduce per step and rank. Collective (a gather)."""
    peak_mb = accelerator.gather(torch.tensor([peak_memory_mb(accelerator.device)], device=accelerator.device))
    return {
        "n_params": n_params,
        "peak_memory_mb_max_rank": round(peak_mb.max().item(), 1),
        "peak_memory_mb_all_ranks": round(peak_mb.sum().item(), 1),
        "gradient_allreduce_mib_per_step_per_rank": round(allreduce_mib, 3),
    }


def sharded_summary(accelerator, layout, n_params: int, optimizer_name: str, model, optimizer) -> dict:
    """The cost figures of a sharded run's summary: measured bytes per rank (largest rank)
    against DDP's and the ideal split (the first step's collectives: RunMonitor.summary). Collective
    (gathers)."""
    state_bytes = training_state_bytes(model, optimizer)
    measured = {
        k: gather_max(accelerator, state_bytes.get(k, 0))
        for k in ("param_bytes", "grad_bytes", "optimizer_bytes", "total_bytes")
    }
    ideal = (
        ddp_state_bytes(n_params, optimizer_name)["total_bytes"] / layout.model_split
    )  # DDP's bytes over every different piece
    return {
        "n_params": n_params,
        "layout": layout.describe(),
        "peak_memory_mb_max_rank": round(gather_max(accelerator, peak_memory_mb(accelerator.device)), 1),
        "state_bytes_per_rank_max": measured,
        "ddp_state_bytes_per_rank": ddp_state_bytes(n_params, optimizer_name),
        "ideal_state_bytes_per_rank": round(ideal),
        "state_vs_ideal": round(measured["total_bytes"] / ideal, 4),
        "unsharded_param_bytes": 4 * n_params,
    }


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives run while it is active, forward and backward, and the size of the
    full buffer each works on (the unsharded tensor of an all-gather or reduce-scatter): the
    DTensor collectives of TP (functional ops) and the c10d ops of FSDP, pipeline send/recv and
    plain torch.distributed calls. `enabled=False` makes it a no-op (the steps after the first)."""

    NAMES = {
        "all_reduce": "all_reduce",
        "allreduce_": "all_reduce",
        "all_gather_into_tensor": "all_gather",
        "_allgather_base_": "all_gather",
        "allgather_": "all_gather",
        "allgather_into_tensor_coalesced_": "all_gather",
        "reduce_scatter_tensor": "reduce_scatter",
        "_reduce_scatter_base_": "reduce_scatter",
        "reduce_scatter_": "reduce_scatter",
        "reduce_scatter_tensor_coalesced_": "reduce_scatter",
        "all_to_all_single": "all_to_all",
        "broadcast_": "broadcast",
        "send": "send",
        "recv_": "recv",
    }

    def __init__(self, enabled: bool = True):
        super().__init__()
        self.enabled = enabled
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)

    def __enter__(self):
        return super().__enter__() if self.enabled else self

    def __exit__(self, *exc):
        return super().__exit__(*exc) if self.enabled else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if func.namespace in ("_c10d_functional", "c10d") and name in self.NAMES:
            kind = self.NAMES[name]
            tensors = [
                t for a in args for t in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(t, torch.Tensor)
            ]
            buffer = max((t.nbytes for t in tensors), default=0)  # the full (unsharded) buffer of the collective
            if func.namespace == "_c10d_functional" and kind == "all_gather":
                buffer *= args[1]  # functional all-gather gets the shard and the group size
            self.calls[kind] += 1
            self.bytes[kind] += buffer
        return func(*args, **(kwargs or {}))

    def report(self) -> dict:
        return {
            kind: {"calls": self.calls[kind], "mib": round(self.bytes[kind] / 2**20, 4)} for kind in sorted(self.calls)
        }
