"""Tied weights (one parameter under two names: a decoder tied to its embedding) under tensor parallelism.
parallelize_module gives each module it cuts a parameter of its own, so a plan that cuts a tied parameter
trains its twins apart, silently (docs/troubleshooting.md, "A TP plan cuts a tied weight"). A 🤗 model's tied
embeddings are refused before its plan is built (common/hf.py, check_untied); this covers any model."""

from __future__ import annotations

from fnmatch import fnmatch

import torch.nn as nn
from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleOutput

from .errors import UsageError


def tied_groups(model: nn.Module) -> list[list[str]]:
    """The names of each parameter the model holds under more than one name, in the model's order."""
    names: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def cutting_style(parameter_name: str, plan: dict):
    """The plan's style that distributes this parameter (its module's, or an ancestor's), or None. Keys match
    as parallelize_module matches them: one fnmatch pattern per dotted part."""
    owner = parameter_name.split(".")[:-1]
    for key, style in plan.items():
        parts = key.split(".")
        moves_weights = not isinstance(style, (PrepareModuleInput, PrepareModuleOutput))
        if moves_weights and len(parts) <= len(owner) and all(map(fnmatch, owner, parts)):
            return style
    return None


def check_tp_keeps_ties(model: nn.Module, plan: dict) -> None:
    """Before parallelize_module, every rank: a plan that cuts a tied parameter is one line naming its names."""
    for group in tied_groups(model):
        cut = {name: style for name in group if (style := cutting_style(name, plan)) is not None}
        if not cut:
            continue  # left whole: one parameter on every rank, still tied
        whole = [name for name in group if name not in cut]
        cuts = " and ".join(f"{name} ({type(style).__name__})" for name, style in cut.items())
        modules = " and ".join(name.rpartition(".")[0] for name in cut)
        raise UsageError(
            f"the TP plan cuts {cuts}{' but not ' + ', '.join(whole) if whole else ''}, one parameter under "
            f"{len(group)} names (tied weights): parallelize_module gives each module it cuts a parameter of its own, "
            f"so they would train untied, silently; leave {modules} out of the plan (the tied weight then runs whole "
            "on every rank), untie them in the MODEL section (docs/your-model.md), or train with train_ddp.py or "
            "train_fsdp.py"
        )
