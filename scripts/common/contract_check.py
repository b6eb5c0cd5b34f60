"""The contract check, a guard (one line in each lesson, `# guard: contract`): before step 1 every Task
method runs once on 4 validation samples, then evaluation's cut and a trial export, so that a mistake in a
script's MODEL section is one `error:` line naming the method, what it returned and what was expected,
instead of a traceback or a silently wrong loss after training (docs/your-model.md)."""

from __future__ import annotations

import os
import tempfile
import traceback
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn as nn
from accelerate.utils import gather_object, send_to_device, slice_tensors
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import default_collate

from .errors import UsageError
from .task import Task, full_outputs, scored_sums

CONTRACT = "fix it in the script's MODEL section (the contract: docs/your-model.md)"
ANSWERS = {  # what each method of the contract answers, for the line that says it is missing
    "inputs": "the model's positional inputs, a tuple: model(*task.inputs(batch))",
    "targets": "what the loss compares the outputs with",
    "count_targets": "the number of targets in a micro-batch, counted before the forward (e.g. batch[1].numel())",
    "loss": "(loss_sum, n_targets) of the outputs: the loss SUMMED over the micro-batch, and its target count",
    "eval_sums": "a dict of sums over a batch",
    "eval_metrics": "a dict of the reported figures with 'eval_loss'",
}


def _contract_error(method: str, returned, expected: str) -> UsageError:
    return UsageError(f"Task.{method} returned {_describe(returned)}; expected {expected}: {CONTRACT}")


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a Tensor of shape {tuple(value.shape)}" if value.dim() else f"a 0-dim Tensor ({value.item():.6g})"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}: ({', '.join(_describe(v) for v in value)})"
    if isinstance(value, dict):
        return f"a dict with keys {sorted(value)}"
    return f"{type(value).__name__} {value!r}"[:120]


def _call(task: Task, method: str, *args):
    """Task.<method>(*args), with a method left unimplemented, or one that raises, as one line."""
    try:
        return getattr(task, method)(*args)
    except NotImplementedError:
        answers = ANSWERS.get(method.removesuffix("_of"), "")
        raise UsageError(
            f"Task.{method} is not implemented in {type(task).__name__}: it returns {answers}; {CONTRACT}"
        ) from None
    except (UsageError, torch.distributed.DistBackendError):
        raise
    except Exception as e:
        where = "the model's forward, model(*Task.inputs(batch))," if method == "loss_of" else f"Task.{method}"
        raise UsageError(
            f"{where} raised {type(e).__name__} on 4 validation samples{_inside_torch(e)}: "
            f"{str(e).splitlines()[0] if str(e) else ''}; {CONTRACT}"
        ) from None


def _inside_torch(error: Exception) -> str:
    """ " inside torch (file: f -> g -> h)" where the error came from torch's own code after the last line of
    the model's or the script's (a wrapper such as DDP's, not the model, may be what failed)."""
    frames = traceback.extract_tb(error.__traceback__)
    own = [i for i, f in enumerate(frames) if f"{os.sep}torch{os.sep}" not in f.filename]
    inner = [f for f in (frames[own[-1] + 1 :] if own else frames) if not f.filename.endswith("module.py")]
    if not inner:
        return ""
    path = inner[0].filename.split(f"{os.sep}torch{os.sep}")[-1]  # nn/parallel/distributed.py: DDP's own
    return f" inside torch (torch/{path}: {' -> '.join(f.name for f in inner[:4])})"


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1)


@torch.no_grad()
def check_task_contract(task: Task, model: nn.Module, validation, device, context=None) -> None:
    """Every rank, before step 1: each Task method once on 4 validation samples, so a mistake is one
    `error:` line naming the method, what it returned and what was expected. The most silent one is a
    loss returned as a MEAN (the script divides by the target count again): the loss of 4 samples must
    equal its two halves' added, and cover Task.count_targets' targets. Then what would fail after training:
    evaluation's cut (2 samples' outputs cut from 4's along Task.sample_dim must score as those 2 alone) and
    a trial export. A str for the model: there is no whole one to run (the cut check's words say why)."""
    if isinstance(model, str):
        return
    trial_export(task, model)
    if len(validation) < 4:
        return
    batch = send_to_device(default_collate([validation[i] for i in range(4)]), device)
    inputs = _call(task, "inputs", batch)
    if not isinstance(inputs, (tuple, list)):
        raise _contract_error(
            "inputs", inputs, "a tuple of the model's positional inputs, e.g. (x,), for model(*inputs)"
        )
    _call(task, "targets", batch)
    counted = _call(task, "count_targets", batch)
    if not _is_number(counted):
        raise _contract_error("count_targets", counted, "the number of targets in the micro-batch (an int)")
    was_training = model.training
    model.eval()  # no dropout; BatchNorm uses its running statistics, so each sample's loss is its own
    with context or nullcontext(), torch.no_grad():  # no graph: nothing here is differentiated
        pair = _call(task, "loss_of", model, batch)
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(_is_number(v) for v in pair)):
            raise _contract_error("loss", pair, "a pair (loss_sum, n_targets) of numbers: the loss SUMMED")
        whole, n_whole = (_float(v) for v in pair)
        halves = [[_float(v) for v in task.loss_of(model, slice_tensors(batch, slice(a, a + 2)))] for a in (0, 2)]
        sums = _scored(task, full_outputs(model(*inputs)), task.targets(batch), 2)  # cut from 4 samples' outputs
        half = slice_tensors(batch, slice(0, 2))
        alone = _scored(task, full_outputs(model(*task.inputs(half))), task.targets(half))  # those 2, nothing cut
        task.check(model, batch)
    model.train(was_training)
    for module in model.modules():  # FSDP keeps a root gathered after forward: shard it again
        if hasattr(module, "reshard") and hasattr(module, "set_requires_gradient_sync"):
            module.reshard()
    counted = _float(counted)
    where = "return (loss_sum, n_targets) from Task.loss in the script's MODEL section (docs/your-model.md)"
    if n_whole != counted:
        raise UsageError(
            f"the loss of a micro-batch covers {n_whole:g} targets but Task.count_targets counts {counted:g}: the "
            f"step's loss is divided by the counted targets, so they must agree; {where}"
        )
    added = halves[0][0] + halves[1][0]
    if abs(whole - added) > 1e-3 * max(abs(whole), abs(added), 1e-6) + 1e-4:
        raise UsageError(
            f"the loss of a micro-batch is not a sum: {whole:.6g} for 4 samples, but {halves[0][0]:.6g} + "
            f"{halves[1][0]:.6g} = {added:.6g} for its two halves (a mean?). The script divides the step's loss by "
            f"its target count itself: use reduction='sum'; {where}"
        )
    if not (isinstance(sums, dict) and all(_is_number(v) for v in sums.values())):
        raise _contract_error("eval_sums", sums, "a dict of numbers, sums over the batch (added over batches, ranks)")
    for key, cut, own in ((k, _float(v), _float(alone[k])) for k, v in sums.items() if _is_real(v)):
        if abs(cut - own) > 1e-3 * max(abs(cut), abs(own), 1e-6) + 1e-4:  # counts may flip an argmax: not compared
            raise UsageError(
                f"evaluation cuts the outputs' samples along dimension {task.sample_dim} (Task.sample_dim), but they "
                f"are not there: Task.eval_sums' {key!r} of 2 samples is {cut:.6g} cut from 4 samples' outputs, "
                f"{own:.6g} from theirs alone. Time-major outputs (T, B, ...) need sample_dim = 1; {CONTRACT}"
            )
    metrics = _call(task, "eval_metrics", {k: _float(v) for k, v in sums.items()} | {"samples": 2.0})
    if not isinstance(metrics, dict) or not _is_number(metrics.get("eval_loss")):
        raise _contract_error("eval_metrics", metrics, "a dict of the reported figures, with 'eval_loss' a number")


def _scored(task: Task, outputs, targets, n: int | None = None) -> dict:
    """Task.eval_sums of the first n samples, cut from the outputs as evaluation cuts off its padding (None: all)."""
    try:
        return (
            scored_sums(task, outputs, targets, n)
            if n
            else task.eval_sums(getattr(outputs, "logits", outputs), targets)
        )
    except (UsageError, torch.distributed.DistBackendError):
        raise
    except Exception as e:
        raise UsageError(
            f"Task.eval_sums raised {type(e).__name__} on 2 samples cut from 4 validation samples' outputs along "
            f"dimension {task.sample_dim} (Task.sample_dim), as evaluation cuts off its padding: "
            f"{str(e).splitlines()[0].rstrip('.') if str(e) else ''}; time-major outputs (T, B, ...) need "
            f"sample_dim = 1; {CONTRACT}"
        ) from None


def trial_export(task: Task, model: nn.Module) -> None:
    """Every rank, before step 1 (the gather is a collective): the model as built, exported the run's way
    (Task.export) into a temporary folder, then deleted: an export that would fail after training fails now."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    error = None
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:  # the main process writes
        try:
            with tempfile.TemporaryDirectory() as tmp:
                if getattr(task, "lora", None):  # LoRA: the adapter, and the base or merged model (lora.py)
                    task.lora["export"](task, state, Path(tmp), {}, lambda t, sd, folder, _: t.export(sd, folder, {}))
                else:
                    task.export(state, Path(tmp) / "model", {})
        except Exception as e:
            error = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    error = next((e for e in gather_object([error]) if e), None)  # every rank stops, not the main one alone
    if error:
        raise UsageError(
            f"a trial export before step 1 (Task.export of the model as built, into a temporary folder) raised "
            f"{error}: the run's export would fail so after training; fix Task.export in the script's MODEL "
            "section (docs/your-model.md)"
        )


def _is_real(value) -> bool:  # not a count
    return isinstance(value, float) or (isinstance(value, torch.Tensor) and value.is_floating_point())


def _float(value) -> float:
    if hasattr(value, "full_tensor"):  # a DTensor (loss parallel)
        value = value.full_tensor()
    return float(value)
