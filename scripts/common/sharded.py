"""What a script that applies its strategy itself on a device mesh needs around it (FSDP, TP, PP, CP,
EP, hybrid): the launch check, a process group for a one-process run, the loader sharded over the
data-parallel ranks only, and gradient clipping over sharded (DTensor) gradients and pipeline stages.
A replicated run needs none of it (Local SGD only the launch check, to refuse a sharded launch)."""

from __future__ import annotations

import os
from collections import defaultdict

import torch
import torch.distributed as dist
from accelerate.data_loader import prepare_data_loader
from torch.distributed.tensor import DTensor

from .errors import UsageError


def launcher_sharding() -> str | None:
    """The sharded strategy an Accelerate config asked for, from the launcher's environment (on CPU the
    Accelerator silently drops an FSDP config: docs/troubleshooting.md)."""
    return next(
        (
            name
            for name in ("FSDP", "DEEPSPEED", "MEGATRON_LM")
            if os.environ.get(f"ACCELERATE_USE_{name}", "false").lower() == "true"
        ),
        None,
    )


def check_sharded_launch(accelerator) -> None:
    """A script that applies its strategy itself refuses a launch that also asks Accelerate for
    one (it would shard twice on GPUs, and be silently dropped on CPU: docs/troubleshooting.md,
    "Accelerate's FSDP config is ignored on CPU"), and fp16, whose loss scaler does not handle
    sharded gradients."""
    sharded = launcher_sharding()
    if sharded:
        raise UsageError(
            f"this script applies its strategy itself with PyTorch's APIs, but the launch also asked Accelerate for "
            f"{sharded}: launch with a plain multi-process config, e.g. --config_file "
            "accelerate_configs/cpu_multi.yaml (or gpu_multi.yaml)"
        )
    if accelerator.mixed_precision == "fp16":
        raise UsageError(
            "--mixed_precision fp16 is not supported by the sharded strategies (its loss scaler does not handle "
            "sharded gradients): launch with --mixed_precision bf16 or no"
        )


def init_one_process_group(accelerator) -> None:
    """A DeviceMesh needs a process group, but `python scripts/X.py` and a one-process launch
    create none (Accelerate needs none for one process): make a one-process group, in memory
    (docs/troubleshooting.md, "A sharded script run as one process")."""
    if torch.distributed.is_initialized():
        return
    backend = "cpu:gloo,cuda:nccl" if accelerator.device.type == "cuda" else "gloo"
    torch.distributed.init_process_group(
        backend,
        store=torch.distributed.HashStore(),
        rank=0,
        world_size=1,
        device_id=accelerator.device if accelerator.device.type == "cuda" else None,
    )


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
