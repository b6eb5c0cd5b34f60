"""Pieces of a training run that every strategy shares: --compile of the units, the optimizer, the LR schedule,
and the endless stream of micro-batches with a resumable, layout-free data position and dropout seeds."""

from __future__ import annotations

import math
import signal
import threading

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from .run_state import RunPosition


def compile_units(units, accelerator) -> None:
    """--compile: `torch.compile` each block in place (names, so checkpoints, do not change), torchtitan's
    way: after TP and activation checkpointing, before FSDP (its hooks stay outside the compiled code)."""
    blocks = unit_modules(units)
    accelerator.print(
        f"--compile: compiling the {len(blocks)} repeated unit(s) of this rank with torch.compile; the first "
        "step (and the first evaluation) waits for the compiler: a minute or more on a CPU, seconds once cached"
    )
    for block in blocks:
        block.compile()


def has_parameters(module) -> bool:
    """False for the placeholders a pipeline split leaves where another stage's units were."""
    return any(True for _ in module.parameters())


def unit_modules(units) -> list:
    """The units of a ModuleDict or ModuleList that this rank holds."""
    return [u for u in (units.values() if isinstance(units, torch.nn.ModuleDict) else units) if has_parameters(u)]


def restride_buffers(model) -> int:
    """Give every buffer with unusual strides (a size-1 dimension's stride not the row-major one, as a
    transpose leaves it) the row-major layout, values unchanged; returns how many. DDP broadcasts the
    buffers before each forward, and its coalesced broadcast refuses such a tensor ("some elements of
    the input tensor and the written-to tensor refer to a single memory location")."""
    changed = 0
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.stride() != torch.empty(buffer.shape).stride():
                module._buffers[name], changed = buffer.clone(memory_format=torch.contiguous_format), changed + 1
    return changed


def make_optimizer(model, args, replicas: int = 1) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not biases, norms), plain SGD, or Muon for the hidden
    matrices beside AdamW for the rest (common/muon.py; `replicas`: DDP's processes, which step on the same
    averaged gradients, so Muon deals its matrices over them). Each kind of parameter
    (plain, or a DTensor's mesh and placements) gets its own group, so the multi-tensor kernels run:
    AdamW's fused one, else `foreach` (docs/troubleshooting.md, "Slow or failing optimizer with DTensor
    parameters")."""
    params = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters only
    groups: dict[tuple, list] = {}
    for p in params:
        kind = (p.device_mesh, p.placements) if isinstance(p, DTensor) else None
        groups.setdefault((p.dim() >= 2, kind), []).append(p)
    param_groups = [
        {"params": params, "weight_decay": args.weight_decay if decay else 0.0} for (decay, _), params in groups.items()
    ]
    kernels = {"foreach": True} if any(isinstance(p, DTensor) for p in params) else {}
    if args.optimizer == "muon":
        from .muon import make_muon  # only a Muon run (the Newton–Schulz iteration, the layouts' gathers)

        fused = {"fused": True} if all(p.device.type in ("cpu", "cuda") for p in params) else {}
        return make_muon(model, args, groups, kernels or fused, replicas)
    if args.optimizer == "sgd":
        optimizer = torch.optim.SGD(param_groups, lr=args.learning_rate, **kernels)
    else:
        if all(p.device.type in ("cpu", "cuda") for p in params):
            kernels = {"fused": True}
        optimizer = torch.optim.AdamW(param_groups, lr=args.learning_rate, betas=(0.9, 0.95), **kernels)
    return optimizer


def make_scheduler(optimizer, args, min_ratio: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up, then cosine decay to `min_ratio` of the peak at --max_steps (optimizer steps)."""

    def lr_factor(step: int) -> float:
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = min(1.0, (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


class StepFeed:
    """Feeds each optimizer step: (1) its micro-batches, epoch after epoch, from a data position that
    does not depend on the layout (epoch, samples of it consumed); (2) the target count of the global
    batch, an all-reduce started one step ahead so that it never makes a step wait; (3) whether this is
    the last step, because SIGTERM or Ctrl-C reached a rank (preemption): the request travels with the
    count, so every rank stops at the same step."""

    def __init__(
        self,
        accelerator,
        loader,
        sampler,
        global_batch_size: int,
        gradient_accumulation_steps: int,
        progress: dict,
        count_targets,
        dp_group=None,
    ):
        self.count_targets = count_targets
        self.accelerator, self.loader, self.sampler = accelerator, loader, sampler
        self.global_batch_size, self.grad_accum = global_batch_size, gradient_accumulation_steps
        self.epoch, self.samples_in_epoch = progress["epoch"], progress["samples_in_epoch"]
        self.step = progress["step"]  # steps handed out so far: named if a peer is lost (RunPosition)
        self.samples_per_epoch = len(sampler)  # a whole number of global batches
        self.dp_group = dp_group  # None: all processes are data-parallel ranks
        self.dropout_stream = None  # [seed, stream]: set by seed_dropout
        # SIGTERM (what SLURM and Kubernetes send before a kill) or Ctrl-C on any rank asks the run to stop
        self.stop_requested = self.preempted = False
        signals = (signal.SIGTERM, signal.SIGINT) if threading.current_thread() is threading.main_thread() else ()
        self._old_handlers = {sig: signal.signal(sig, self._request_stop) for sig in signals}  # main thread only
        self._batches = self._iterate()
        self._next = self._fetch()

    def _iterate(self):
        epoch, skip_samples = self.epoch, self.samples_in_epoch
        while True:
            per_rank_micro_batch = self.loader.total_batch_size  # batch_size x processes
            loader = (
                self.accelerator.skip_first_batches(self.loader, skip_samples // per_rank_micro_batch)
                if skip_samples
                else self.loader
            )
            loader.set_epoch(epoch)  # a new order every epoch; forgetting this repeats epoch 0's
            self.sampler.set_epoch(epoch)
            yield from loader
            epoch, skip_samples = epoch + 1, 0

    def _request_stop(self, signum, frame) -> None:
        if self.stop_requested and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.stop_requested = True

    def _fetch(self):
        micro_batches = [next(self._batches) for _ in range(self.grad_accum)]
        device = self.accelerator.device
        count = torch.as_tensor(sum(self.count_targets(mb) for mb in micro_batches), device=device).float().reshape(())
        stop = torch.tensor([float(self.stop_requested)], device=device)
        works = []
        distributed = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
        if distributed and torch.distributed.get_world_size(self.dp_group) > 1:
            works.append(torch.distributed.all_reduce(count, group=self.dp_group, async_op=True))
        if distributed:  # over every rank: all of them must stop at the same step
            works.append(torch.distributed.all_reduce(stop, async_op=True))
        return micro_batches, count, stop, works

    def next_step(self) -> tuple[list, torch.Tensor]:
        """This rank's micro-batches of the next step, and the global batch's target count."""
        micro_batches, count, stop, works = self._next
        self.step += 1
        RunPosition.step = self.step
        RunPosition.waiting = "all_reduce (the step's target count)"
        for work in works:
            work.wait()
        RunPosition.waiting = None
        self.preempted = bool(stop.item() > 0)  # the same on every rank: this is the last step
        self._next = self._fetch()  # the next step's count travels while this step computes
        if self.dropout_stream:  # after the fetch above (a loader it starts draws); SeedSequence: no collisions
            torch.manual_seed(int(np.random.SeedSequence([*self.dropout_stream, self.step]).generate_state(1, "u8")[0]))
        self.samples_in_epoch += self.global_batch_size
        if self.samples_in_epoch == self.samples_per_epoch:
            self.epoch, self.samples_in_epoch = self.epoch + 1, 0
        return micro_batches, count

    def seed_dropout(self, seed: int, layout=None) -> None:
        """Each step then seeds torch's generators from (seed, stream, step): a resume draws the straight run's masks
        whatever drew in between (a loader started, a check's forward). A stream per data-parallel rank, pipeline
        stage and CP rank; a TP group shares one (its replicated activations must be dropped alike)."""
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.dropout_stream = [seed % 2**64, rank // layout.tp if layout else rank]  # tp: the innermost mesh dim
        if layout and layout.mesh.device_type != "cpu":  # else DTensor's first dropout broadcasts rank 0's state
            torch.distributed.tensor._random.manual_seed(seed, layout.sub("tp"))  # to all: its tracker, without that

    def close(self) -> None:
        """Wait for the count started ahead (before teardown); give SIGTERM and SIGINT their handlers back."""
        RunPosition.finished = True
        RunPosition.waiting = "all_reduce (the step's target count)"
        for work in self._next[3]:
            work.wait()
        RunPosition.waiting = None
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)

    def position(self) -> dict:
        return {"epoch": self.epoch, "samples_in_epoch": self.samples_in_epoch}
