"""Where a cut that does not compute the model first parts from it (common/cut_check.py's
check_cut, once the probe's loss or gradients differ): one more probe step, each module's output
against the uncut model's, in the cut model's order of execution. Imported only by a run whose cut
check fails."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from .cut_check import RTOL, _gap


def _first_output(output):
    """The tensor a module's output leads with (a tuple's first, a 🤗 output's first field)."""
    while isinstance(output, (tuple, list)) or hasattr(output, "to_tuple"):
        output = output[0] if len(output) else None
    if isinstance(output, DTensor):
        output = output.full_tensor()  # a collective: the TP ranks run the same modules in the same order
    return output if isinstance(output, torch.Tensor) else None


def _plain_name(name: str) -> str:
    for wrapper in ("module.", "_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module."):
        name = name.replace(wrapper, "")
    return name


def first_parting(model, step_fn, mine, n_targets, reference, task, all_mbs, dp_rank, grad_accum):
    """(module name, gap) of the first module, in the cut model's order of execution, whose output on
    this rank's first probe micro-batch differs from the uncut model's on the same samples (CP: at this
    rank's positions); None if no output it can compare differs."""
    uncut, cut, hooks = {}, [], []

    def keep(store, name, only_first):
        def hook(module, args, output):
            if isinstance(store, dict) and name not in store:
                out = _first_output(output)
                store[name] = None if out is None else out.detach().float().cpu()
            elif isinstance(store, list) and (not only_first or name not in {n for n, _ in store}):
                out = _first_output(output)
                store.append((name, None if out is None else out.detach().float().cpu()))

        return hook

    try:
        hooks = [m.register_forward_hook(keep(uncut, n, True)) for n, m in reference.named_modules() if n]
        with torch.no_grad():
            task.loss_of(reference, all_mbs[dp_rank * grad_accum])
        for h in hooks:
            h.remove()
        hooks = [m.register_forward_hook(keep(cut, _plain_name(n), True)) for n, m in model.named_modules() if n]
        step_fn(mine, n_targets)  # the lesson's own step: its collectives run on every rank
    finally:
        for h in hooks:
            h.remove()
    positions, seen = getattr(step_fn, "token_positions", None), set()
    for name, out in cut:
        if name in seen or out is None or uncut.get(name) is None:
            continue
        seen.add(name)
        ref = uncut[name]
        cut_sequence = positions is not None and ref.dim() >= 2 and out.dim() == ref.dim()
        if cut_sequence and out.shape[1] == len(positions) and ref.shape[1] > int(positions.max()):
            ref = ref[:, positions.cpu()]  # CP: this rank's tokens of the whole sequence
        if out.shape == ref.shape and _gap(out, ref)[1] > RTOL["no"]:
            return name, _gap(out, ref)[0]
    return None
