"""The model contract: what a script needs to know about the model it trains. Its MODEL section builds
the model and a `Task`; nothing else assumes which model is trained (docs/your-model.md).

    Task                          what it answers (for what)
    units(model)                  the units to cut at: a container, a list of submodules, or none (FSDP, PP)
    inputs(batch)                 the model's positional inputs (every forward)
    targets(batch)                what the loss compares with (the loss; PP's last stage)
    count_targets(batch)          a micro-batch's targets, before the forward (the divisor of the step's loss)
    loss(outputs, targets)        (loss_sum, n_targets): a SUM (backward, the logged loss)
    eval_sums / eval_metrics      sums over a batch / the reported figures, with eval_loss (evaluation)
    sample_dim                    the outputs' dimension that holds the samples: 0, or 1 if time-major (T, B, ...)
    describe / tokens_per_sample  the banner's line / tokens in a sample, or None (samples/s)
    export(state_dict, dir)       writes the final model (OUTPUT_DIR/model)
    set_attention / forward_at    context parallelism: an attention function; a forward at given positions

`check_task_contract` (common/contract_check.py, a guard) runs every method, the evaluation's cut and a
trial export once before step 1: a mistake is one line. A causal LM's Task is `CausalLMTask`
(common/causal_lm.py).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.nn as nn
from accelerate.utils import recursively_apply, slice_tensors
from torch.distributed.tensor import DTensor

from .errors import UsageError


class Task:
    """The contract. Subclass it in a script's MODEL section for a model of your own."""

    name = "task"
    tokens_per_sample: int | None = None  # None: throughput in samples/s only
    units_path = "blocks"  # where the repeated units are (for the error that names what the model has)
    sample_dim = 0  # the outputs' dimension of the samples: evaluation cuts off its padding there (1: time-major)

    def units(self, model: nn.Module):
        return find_units(model, self.units_path)

    def inputs(self, batch) -> tuple:
        raise NotImplementedError

    def targets(self, batch):
        raise NotImplementedError

    def count_targets(self, batch) -> torch.Tensor:
        raise NotImplementedError

    def loss(self, outputs, targets) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def loss_of(self, model: nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor]:  # one micro-batch
        return self.loss(model(*self.inputs(batch)), self.targets(batch))

    def check(self, model: nn.Module, batch) -> None:
        """Checks of your own, run once before step 1 on 4 validation samples (no gradients, eval mode);
        raise UsageError for one line. CausalLMTask: documents kept apart under --document_mask."""

    def eval_sums(self, outputs, targets) -> dict:
        loss_sum, n = self.loss(outputs, targets)
        return {"loss": loss_sum, "targets": n}

    def eval_metrics(self, sums: dict) -> dict:
        return {"eval_loss": sums["loss"] / max(sums["targets"], 1)}

    def describe(self, model: nn.Module) -> str:
        n = sum(p.numel() for p in model.parameters())
        return f"model {type(model).__name__}: {n / 1e6:.2f}M parameters"

    def flops_per_item(self, n_params: int) -> float | None:
        """Training FLOPs per token (or per sample without tokens), for MFU; None: unknown."""
        return None

    def config(self) -> dict:  # config.json, beside the weights
        return {"task": self.name}

    def export(self, state_dict: dict, model_dir, data_source: dict) -> None:  # one process
        write_model_dir(state_dict, self.config(), data_source, model_dir)

    # ---- context parallelism (train_cp.py): the attention is replaceable, the positions are given
    def set_attention(self, model: nn.Module, attention) -> None:
        """Every attention layer calls `attention(q, k, v, dropout_p=0.0)` (causal) instead of its own; with
        --document_mask also `documents=` (the ids forward_at was given)."""
        raise UsageError(
            f"context parallelism replaces the model's attention, but this model's Task ({type(self).__name__}) "
            "does not say how: implement Task.set_attention and Task.forward_at in the script's MODEL section "
            "(docs/your-model.md; the built-in GPT has them), or train without --cp_size"
        )

    def forward_at(self, model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, documents=None):
        """The model's outputs for `input_ids`, some tokens of each sequence, at their real `positions`;
        `documents` (--document_mask): the whole sequences' document ids, for every attention call."""
        raise NotImplementedError


def find_units(model: nn.Module, path):
    """The units the strategies cut the model at (FSDP units, activation checkpointing, --compile, the
    pipeline split), named by `path`: a container ("blocks", "model.layers"), a list of submodules
    (["conv1", "conv2"]: parameter names do not change), or None (FSDP shards the whole model as one).
    A container is an nn.ModuleDict, an nn.ModuleList or an nn.Sequential (timm's `blocks`): a Sequential
    runs its children in order, so each is a unit as a list's would be, on one process as on many."""
    if path is None or isinstance(path, (list, tuple)):
        return nn.ModuleList(_submodule(model, name, name) for name in path or [])
    obj = _submodule(model, path, "the container of repeated units")
    if not isinstance(obj, (nn.ModuleDict, nn.ModuleList, nn.Sequential)) or len(obj) == 0:
        raise UsageError(
            f"'{path}' of {type(model).__name__} is a {type(obj).__name__}, not a non-empty nn.ModuleDict, "
            "nn.ModuleList or nn.Sequential of repeated units: name a container of blocks, a list of submodules "
            '(units_path = ["conv1", "conv2"]) or None in the script\'s MODEL section (Task.units; docs/your-model.md)'
        )
    return obj


def _submodule(model: nn.Module, path: str, what: str) -> nn.Module:
    obj = model
    for part in path.split("."):
        if not isinstance(getattr(obj, part, None), nn.Module):
            children = ", ".join(name for name, _ in obj.named_children()) or "none"
            raise UsageError(
                f"the model ({type(model).__name__}) has no '{path}' ({what}: FSDP units, activation checkpointing, "
                f"--compile, the pipeline split); {'its' if obj is model else f'its {part!r} has'} children are: "
                f"{children}. Name your model's units in the script's MODEL section: a container "
                '(units_path = "layers"), a list of submodules (units_path = ["conv1", "conv2"]) or None '
                "(Task.units; docs/your-model.md)"
            )
        obj = getattr(obj, part)
    return obj


def write_model_dir(state_dict: dict, config: dict, data_source: dict, model_dir) -> None:
    """One process: a full state dict as `model_dir/` (safetensors, config, data), renamed into place. Tied
    weights (one tensor under two names) are saved once, the ties in the file's metadata (exported.py re-ties)."""
    from safetensors.torch import save_file

    model_dir = Path(model_dir)
    tmp = model_dir.with_name(f".tmp_{model_dir.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    first, saved, tied = {}, {}, {}  # safetensors refuses tensors that share memory
    for name, v in state_dict.items():
        same = (v.data_ptr(), v.dtype, v.shape, v.stride()) if v.numel() else name
        tied[name] = first.setdefault(same, name)
        if tied[name] == name:
            saved[name] = v.contiguous()
    tied = {name: twin for name, twin in tied.items() if name != twin}
    save_file(saved, str(tmp / "model.safetensors"), {"tied": json.dumps(tied)} if tied else None)
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    (tmp / "data.json").write_text(json.dumps(data_source, indent=1))
    replace_dir(tmp, model_dir)


def replace_dir(tmp: Path, final: Path) -> None:
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


def scored_sums(task, outputs, targets, n: int) -> dict:
    """Task.eval_sums of a batch's first n samples: the outputs cut along Task.sample_dim (1: time-major, (T, B,
    ...)), the targets (collated rows) along 0. check_task_contract cuts the same way before step 1."""
    outputs = getattr(outputs, "logits", outputs)  # a 🤗 output object: Task.eval_sums gets its logits
    outputs = recursively_apply(lambda t: t.narrow(task.sample_dim, 0, n), outputs)
    return task.eval_sums(outputs, slice_tensors(targets, slice(0, n)))


def full_outputs(outputs):
    """Outputs that are DTensors (vocabulary-sharded logits under loss parallel) as full tensors."""
    if isinstance(outputs, DTensor):
        return outputs.full_tensor()
    if isinstance(getattr(outputs, "logits", None), DTensor):  # a 🤗 output object
        outputs.logits = outputs.logits.full_tensor()
    return outputs
