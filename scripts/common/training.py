"""Pieces of a training run that every strategy shares: --compile of the units, the optimizer, the
LR schedule, gradient clipping over sharded gradients, and the endless stream of micro-batches with
a resumable, layout-free data position."""

from __future__ import annotations

import math
import signal
import threading
from collections import defaultdict

import torch
import torch.distributed as dist
from accelerate.data_loader import prepare_data_loader
from torch.distributed.tensor import DTensor

from .errors import RunPosition


def compile_units(units, accelerator) -> None:
    """--compile: `torch.compile` each transformer block, torchtitan's way. After TP and activation
    checkpointing, which change what a block computes, and before FSDP, whose gather and
    reduce-scatter hooks then stay outside the compiled code (dynamo skips FSDP2's hooks). In
    place (`Module.compile`), so parameter names, and so checkpoints, do not change. Every block
    runs the same code on the same shapes: the first one's compilation serves the others."""
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


def make_optimizer(model, args) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not biases, norms), or plain SGD.

    Sharded models hold DTensor parameters, often beside plain ones, or DTensors on different
    meshes and placements. The multi-tensor kernels need one kind per parameter group, and
    without them every parameter of every step goes through DTensor dispatch one op at a time
    (docs/troubleshooting.md, "Slow or failing optimizer with DTensor parameters"). So every
    kind, (mesh, placements) or plain, gets its own group, and the fastest kernel is asked for:
    - AdamW's fused kernel, with every parameter on the CPU or on CUDA: one op per group and
      step, so one DTensor dispatch per group (on the CPU too: a third of the `foreach` time for
      plain tensors, half of it for DTensors);
    - otherwise (SGD, or other devices) `foreach` for DTensors, which torch's default turns off
      for them: one dispatch per op per group instead of per parameter."""
    params = list(model.parameters())
    groups: dict[tuple, list] = {}
    for p in params:
        kind = (p.device_mesh, p.placements) if isinstance(p, DTensor) else None
        groups.setdefault((p.dim() >= 2, kind), []).append(p)
    param_groups = [
        {"params": params, "weight_decay": args.weight_decay if decay else 0.0} for (decay, _), params in groups.items()
    ]
    kernels = {"foreach": True} if any(isinstance(p, DTensor) for p in params) else {}
    if args.optimizer == "sgd":
        optimizer = torch.optim.SGD(param_groups, lr=args.learning_rate, **kernels)
    else:
        if all(p.device.type in ("cpu", "cuda") for p in params):
            kernels = {"fused": True}
        optimizer = torch.optim.AdamW(param_groups, lr=args.learning_rate, betas=(0.9, 0.95), **kernels)
    return optimizer


def make_scheduler(optimizer, args, min_ratio: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up to the peak, then cosine decay to `min_ratio` of it at --max_steps.
    Counted in optimizer steps, so it is the same for any number of processes."""

    def lr_factor(step: int) -> float:
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = min(1.0, (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


class StepFeed:
    """Feeds each optimizer step what it needs, and nothing else does: (1) its micro-batches, epoch
    after epoch, from a data position that does not depend on the layout; (2) the target count of
    the whole global batch, an asynchronous all-reduce; (3) whether this is the last step, because
    SIGTERM or Ctrl-C reached a rank (preemption): the request travels with the count, so every
    rank learns it at the same step.

    The count needs an all-reduce over the data-parallel ranks. It is started one step ahead
    (asynchronously, for the step after the one handed out), so it never makes a step wait: a
    blocking all-reduce per step cost 4% of the step time on 2 CPU processes.

    The position is (epoch, samples of that epoch consumed by the whole run); on resume each rank
    skips its share with `accelerator.skip_first_batches`. The loader that returns starts at
    epoch 0 (docs/troubleshooting.md, "Resume is not exact"), so the epoch is set on it, and on the sampler, every pass.
    """

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
        """`progress`: where the run stands (load_checkpoint's answer): epoch and samples_in_epoch.
        `count_targets(micro_batch)`: its number of targets (Task.count_targets)."""
        self.count_targets = count_targets
        self.accelerator, self.loader, self.sampler = accelerator, loader, sampler
        self.global_batch_size, self.grad_accum = global_batch_size, gradient_accumulation_steps
        self.epoch, self.samples_in_epoch = progress["epoch"], progress["samples_in_epoch"]
        self.step = progress["step"]  # steps handed out so far: named if a peer is lost (RunPosition)
        self.samples_per_epoch = len(sampler)  # a whole number of global batches
        self.dp_group = dp_group  # None: all processes are data-parallel ranks
        # Preemption: SIGTERM (what SLURM and Kubernetes send before they kill a job) or Ctrl-C on
        # any rank asks the run to stop. The request travels with the next step's target count, so
        # every rank learns it at the same step and they all stop there, after a checkpoint.
        self.stop_requested = self.preempted = False
        self._old_handlers = {}
        if threading.current_thread() is threading.main_thread():
            self._old_handlers = {
                sig: signal.signal(sig, self._request_stop) for sig in (signal.SIGTERM, signal.SIGINT)
            }
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
        """This rank's micro-batches of the next optimizer step, and the target count of the global
        batch."""
        micro_batches, count, stop, works = self._next
        self.step += 1
        RunPosition.step = self.step
        RunPosition.waiting = "all_reduce (the step's target count)"
        for work in works:
            work.wait()
        RunPosition.waiting = None
        self.preempted = bool(stop.item() > 0)  # the same on every rank: this is the last step
        self._next = self._fetch()  # the next step's count travels while this step computes
        self.samples_in_epoch += self.global_batch_size
        if self.samples_in_epoch == self.samples_per_epoch:
            self.epoch, self.samples_in_epoch = self.epoch + 1, 0
        return micro_batches, count

    def close(self) -> None:
        """Let the count started for the step after the last one finish (before teardown), and give
        SIGTERM and SIGINT their handlers back."""
        RunPosition.finished = True
        RunPosition.waiting = "all_reduce (the step's target count)"
        for work in self._next[3]:
            work.wait()
        RunPosition.waiting = None
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)

    def position(self) -> dict:
        return {"epoch": self.epoch, "samples_in_epoch": self.samples_in_epoch}


def shard_loader(loader, accelerator, layout):
    """Accelerate's loader sharding, over the data-parallel ranks only: every rank of one TP
    group or one pipeline gets the same micro-batches (prepare() would shard over all ranks)."""
    return prepare_data_loader(
        loader, device=accelerator.device, num_processes=layout.dp, process_index=layout.dp_rank, put_on_device=True
    )


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, pp_group=None) -> torch.Tensor:
    """Clip the global gradient norm when gradients are sharded (DTensor) and/or split over
    pipeline stages; `max_norm` 0 or inf only measures. Returns the norm before clipping, the
    same on every rank.

    A DTensor gradient may come out of backward in another placement than its parameter (a
    replicated LayerNorm weight under sequence parallel gets a Partial sum from each sequence
    slice): it is first brought to the parameter's placement, which the optimizer needs anyway.
    Then torch's own DTensor-aware pieces do the rest: `get_total_norm` per kind of gradient
    (one (mesh, placements) pair, or plain tensors) gives a norm that is partial over the sharded
    mesh dimensions; `full_tensor()` reduces it, one all-reduce per kind; the pipeline stages'
    squares are summed; `clip_grads_with_norm_` scales every gradient with multi-tensor kernels.
    (docs/troubleshooting.md, "Gradient clipping with sharded gradients")"""
    max_norm = max_norm or float("inf")
    parameters = [p for p in parameters if p.grad is not None]
    kinds: dict[tuple, list] = defaultdict(list)
    for p in parameters:
        if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        kinds[(p.device_mesh, p.placements) if isinstance(p.grad, DTensor) else None].append(p)
    squares = []
    for params in kinds.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).double().pow(2))
    total = torch.stack(squares).sum()
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total, group=pp_group)
    norm = total.sqrt().float()
    if max_norm != float("inf"):
        for params in kinds.values():  # a multi-tensor kernel takes one kind of tensor
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return norm
