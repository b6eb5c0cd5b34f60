"""A layer drop across ranks, refused before step 1 (common/cut_check.py calls it on more than one
data-parallel or CP rank): fairseq's LayerDrop skips each layer in training when a random draw falls below
it, and each rank draws its own numbers."""

from __future__ import annotations

import torch
from torch import nn

from .errors import UsageError


def check_no_layer_drop(reference: nn.Module, task, micro_batch, strategy: str) -> None:
    """A model that skips whole units at random in training (fairseq's LayerDrop: the `layerdrop` of XGLM,
    OPT, BioGPT) skips other ones on each data-parallel or CP rank, which draw their own numbers: DDP then
    raises at the next step, FSDP and CP wait for a collective that never comes. Two forwards in training
    mode, every torch.rand draw 1 and then 0: a unit that runs in the first and not in the second is
    dropped at random. Found by what runs, not by a config name; the RNG is left as it was."""
    units = task.units(reference)
    units = list(units.values() if isinstance(units, nn.ModuleDict) else units)  # the GPT's blocks: a dict
    runs = [_units_run(reference, task, micro_batch, units, fill) for fill in (torch.ones, torch.zeros)]
    dropped = sorted(runs[0] - runs[1])
    if dropped:
        raise UsageError(
            f"{strategy}: the model skips layers at random in training (units {dropped} did not run when every "
            "draw was 0: a layer drop, such as a config's layerdrop), and each data-parallel rank would skip "
            "other ones, waiting on each other's collectives: set the layer drop to 0, or train on one process"
        )


def _units_run(model: nn.Module, task, micro_batch, units, fill) -> set[int]:
    """The units that run in one training-mode forward whose torch.rand draws are all `fill`'s."""
    called = set()
    hooks = [u.register_forward_pre_hook(lambda *_, i=i: called.add(i)) for i, u in enumerate(units)]
    rand, was_training = torch.rand, model.training
    torch.rand = lambda *size, generator=None, **kw: fill(*size, **kw)
    try:
        model.train()
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            task.loss_of(model, micro_batch)
    finally:
        torch.rand = rand
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    return called
