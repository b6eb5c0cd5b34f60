"""Evaluation: the Task's figures over every validation sample exactly once, under any layout
(replicated, sharded, tensor- or pipeline-parallel)."""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from accelerate.utils import gather_object, send_to_device
from torch.utils.data import DataLoader, Subset

from .batchnorm import average_running_stats
from .task import full_outputs, scored_sums


@torch.no_grad()
def evaluate(accelerator, model, task, validation, batch_size: int, layout=None, predict=None) -> dict:
    """Task.eval_sums and Task.eval_metrics over every validation sample exactly once, plus `num_samples`.
    Data-parallel rank r scores samples r, r + dp, ...; every rank runs the same number of batches (FSDP
    and the pipeline need all ranks in each forward), the padding cut off before scoring. `predict`
    (default: the model) returns None where there are no outputs (a pipeline's other stages); one rank
    per replica adds its sums (docs/troubleshooting.md, "Evaluation counted once per TP rank")."""
    average_running_stats(model, layout.group("dp") if layout is not None else None)  # a collective; no-op without
    dp = layout.dp if layout is not None else accelerator.num_processes
    dp_rank = layout.dp_rank if layout is not None else accelerator.process_index
    adds_sums = layout is None or layout.holds_loss  # one rank per data-parallel replica
    predict = predict or model
    n = len(validation)
    n_batches = math.ceil(math.ceil(n / dp) / batch_size)
    my_samples = list(range(dp_rank, n, dp))
    indices = (my_samples + [my_samples[0]] * (n_batches * batch_size))[: n_batches * batch_size]
    was_training = model.training
    model.eval()
    sums: dict[str, float] = defaultdict(float)
    for i, batch in enumerate(DataLoader(Subset(validation, indices), batch_size=batch_size)):
        batch = send_to_device(batch, accelerator.device)
        with accelerator.autocast():  # Accelerate: autocast
            outputs = full_outputs(predict(*task.inputs(batch)))  # loss parallel: a collective, every TP rank
        real = min(batch_size, len(my_samples) - i * batch_size)  # the rest of the batch is padding
        if outputs is None or not adds_sums or real <= 0:
            continue
        for key, value in scored_sums(task, outputs, task.targets(batch), real).items():
            sums[key] += float(value)
        sums["samples"] += real
    model.train(was_training)
    every_rank, sums = gather_object([dict(sums)]), defaultdict(float)  # Accelerate: a few numbers per rank
    for key, value in ((k, v) for part in every_rank for k, v in part.items()):
        sums[key] += value
    metrics = {
        k: float(v) if isinstance(v, (int, float, torch.Tensor)) else v for k, v in task.eval_metrics(sums).items()
    }
    return {"eval_loss": metrics.pop("eval_loss", None), "num_samples": int(sums["samples"]), **metrics}
