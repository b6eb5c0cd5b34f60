"""Throughput and MFU over training-step time (RunMonitor's records and summary): tokens (or samples) per
second per report window and in all, the model FLOP utilisation where the device's peak is known, and the
device synchronisation that ends a timed stretch (docs/troubleshooting.md, "Throughput timers on a GPU")."""

from __future__ import annotations

import torch

# Dense bf16 peak FLOP/s of common accelerators, for MFU; CPUs have no reliable figure (use --peak_flops).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12}
PEAK_FLOPS |= {"V100": 125e12, "T4": 65e12}


def peak_flops(device: torch.device, override: float | None) -> float | None:
    if override or device.type != "cuda":
        return override
    return next((v for k, v in PEAK_FLOPS.items() if k in torch.cuda.get_device_name(device)), None)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Throughput:
    """Tokens/s (or samples/s) and MFU over training-step time only: per report window, and in all."""

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
