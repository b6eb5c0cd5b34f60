"""Metrics: the metrics.jsonl writer, throughput, MFU, peak memory, evaluation."""
from __future__ import annotations

import json
import math
import resource
from pathlib import Path

import torch

import torch.nn.functional as F

# Dense bf16 peak FLOP/s of common accelerators, for MFU; CPUs have no reliable figure (use --peak_flops).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12, "V100": 125e12, "T4": 65e12}


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
    """Tokens/s and MFU over training-step time only (evaluation and checkpoints excluded):
    per report window, and over the whole run."""

    def __init__(self, flops_per_token: float, peak: float | None):
        self.flops_per_token, self.peak = flops_per_token, peak
        self.window = [0, 0.0]  # tokens, seconds since the last report
        self.total = [0, 0.0]

    def add(self, tokens: int, seconds: float) -> None:
        for acc in (self.window, self.total):
            acc[0] += tokens
            acc[1] += seconds

    def _figures(self, tokens: int, seconds: float, world_size: int) -> dict:
        tokens_per_sec = tokens / max(seconds, 1e-9)
        mfu = tokens_per_sec * self.flops_per_token / (self.peak * world_size) if self.peak else None
        return {"tokens_per_sec": round(tokens_per_sec, 1), "mfu": None if mfu is None else round(mfu, 4)}

    def report(self, world_size: int) -> dict:
        figures = self._figures(*self.window, world_size)
        self.window = [0, 0.0]
        return figures

    def summary(self, world_size: int) -> dict:
        return {**self._figures(*self.total, world_size), "train_time_s": round(self.total[1], 2)}


@torch.no_grad()
def evaluate(accelerator, model, eval_loader, task: str) -> dict:
    """Eval loss over every validation target, plus the task metric, each sample counted once.

    Each process scores its shard; `gather_for_metrics` collects the per-sample rows and drops
    the duplicates Accelerate adds to even out the last batch (a plain all-gather counts them
    twice). Exact match (addition): the greedy answer equals the reference. Under teacher
    forcing that is "argmax is right at every answer position": if all are right, greedy
    decoding follows the same path; if one is wrong, it leaves the path there.
    """
    model.eval()
    rows = []
    for batch in eval_loader:
        logits = model(batch["input_ids"])
        targets = batch["labels"][:, 1:]  # position t predicts token t+1
        is_target = targets != -100
        token_loss = F.cross_entropy(logits[:, :-1].transpose(1, 2).float(), targets, ignore_index=-100, reduction="none")
        correct = ((logits[:, :-1].argmax(-1) == targets) | ~is_target).all(dim=1)
        # one row per sample: the unit gather_for_metrics de-duplicates
        per_sample = torch.stack([token_loss.sum(1), is_target.sum(1).float(), correct.float()], dim=1)
        rows.append(accelerator.gather_for_metrics(per_sample))
    model.train()
    rows = torch.cat(rows).double()
    eval_loss = (rows[:, 0].sum() / rows[:, 1].sum()).item()
    result = {"eval_loss": eval_loss, "num_samples": rows.shape[0]}
    if task == "addition":
        result["exact_match"] = rows[:, 2].mean().item()
    else:
        result["perplexity"] = round(math.exp(min(eval_loss, 50)), 4)
    return result
