"""The training loader: one shuffled order cut into whole global batches (the same samples at step t on
any layout)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Sampler

from .errors import UsageError


class GlobalBatchSampler(Sampler):
    """The same order on every rank, fixed by (seed, epoch), cut to whole global batches; Accelerate hands
    rank r every dp-th micro-batch of it."""

    def __init__(self, num_samples: int, global_batch_size: int, seed: int):
        self.num_samples = num_samples
        self.usable = num_samples - num_samples % global_batch_size
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.num_samples, generator=g)[: self.usable].tolist())

    def __len__(self) -> int:
        return self.usable


def make_train_loader(train, batch_size: int, global_batch_size: int, seed: int) -> DataLoader:
    if len(train) < global_batch_size:
        raise UsageError(
            f"the train split has {len(train)} samples, fewer than one global batch ({global_batch_size})"
            ": lower --batch_size or --gradient_accumulation_steps"
        )
    sampler = GlobalBatchSampler(len(train), global_batch_size, seed)
    return DataLoader(train, batch_size=batch_size, sampler=sampler, drop_last=True)
