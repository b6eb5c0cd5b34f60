"""Every run of more than one process proves its cut before step 1: the strategy's own forward and
backward, on a probe of a few validation samples, against the uncut model on one rank (the same weights,
gathered from the shards). Two lines of the script start it:

    reference = uncut_copy(model, task)   in the MODEL section's wake, before the strategy cuts anything:
                                          a whole copy (or the start line, where there is none)
    check_cut(...)                        after the strategy, before step 1: one probe step through the
                                          lesson's own step function against the copy (common/cut_probe.py);
                                          its start line "cut checked: ...", or one `error:` line naming the
                                          strategy, the first module where the two part, the gap, and the way
                                          out. --skip_cut_check skips it, loudly.

One process cuts nothing: there is nothing to prove, and the probe is not imported. Nothing here knows a
family, a mask or a plan: a cut that changes what the model computes shows in the numbers, whatever its
name. A model too large for one rank is checked on a shrunken copy of its architecture (common/shrunk.py;
a model of one's own: skipped, and said)."""

from __future__ import annotations

import copy
import os

import psutil
import torch
import torch.distributed as dist
from torch import nn

from .run_state import RunPosition

REFERENCE_BYTES_MAX = 4 * 2**30  # a whole copy beyond this stays unbuilt: the check says it was skipped


def uncut_copy(model: nn.Module, task, skip: bool = False):
    """A whole copy of the model as the MODEL section built it, on the CPU (a 🤗 model still on the meta
    device is made whole there, its weights overwritten by the run's own at the check), or, where there
    is none, the start line: a str; None on one process (nothing is cut). A model too large for one rank is
    checked as a shrunken copy of its architecture (common/shrunk.py: the same script, up to its check, on the
    same config narrowed)."""
    if skip:
        return "cut check: skipped (--skip_cut_check): nothing proves that the cut computes the model"
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return None  # one process: nothing is cut, nothing to check
    n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if n_bytes > reference_bytes_max() and not RunPosition.shrunken_copy:
        from .shrunk import check_shrunken_copy  # imported only by a run whose model is too large

        return check_shrunken_copy(model, task, n_bytes)
    reference = copy.deepcopy(model)
    if any(p.is_meta for p in reference.parameters()):
        to_empty_keeping_ties(reference, "cpu")
        with torch.random.fork_rng(devices=[]):  # its buffers (rotary tables) made as the run's are
            task.materialize(reference)
    return reference.to("cpu")


def reference_bytes_max() -> float:
    """The largest whole copy a rank makes: 4 GiB (its probe step stays in seconds on a CPU), less where
    the host's free memory, shared by its processes, could not hold it three times (weights, gradients,
    activations). CUT_CHECK_MAX_BYTES sets it (0: always the shrunken copy)."""
    if "CUT_CHECK_MAX_BYTES" in os.environ:
        return float(os.environ["CUT_CHECK_MAX_BYTES"])
    free = psutil.virtual_memory().available / max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return min(REFERENCE_BYTES_MAX, free / 3)


def to_empty_keeping_ties(model: nn.Module, device) -> None:
    """`model.to_empty(device)`, but a parameter two modules share (tied weights) stays one: to_empty
    gives each module a tensor of its own, which would untie them silently."""
    slots: dict[int, list] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                slots.setdefault(id(p), []).append((module, name))
    model.to_empty(device=device)
    for tied in (s for s in slots.values() if len(s) > 1):
        first = getattr(*tied[0])
        for module, name in tied[1:]:
            setattr(module, name, first)


def check_cut(accelerator, model, step_fn, reference, task, validation, grad_accum: int, layout=None) -> None:
    """Collective. One probe step through `step_fn(micro_batches, n_global_targets)` (the lesson's own forward
    and backward: it returns this rank's loss sum) against `reference` (common/cut_probe.py's probe_cut says
    what a step may say of itself); prints the start line, or raises UsageError where the cut is not the model.
    The RNG, the model's mode and its gradients are left as they were, so the run that follows is the run
    without the check. Nothing on one process (reference None: nothing is cut)."""
    if reference is None:
        return
    if isinstance(reference, str):  # the start line already: skipped, or checked on a shrunken copy
        line = reference
    else:
        from .cut_probe import probe_cut  # only a run that cut the model probes it

        line = probe_cut(accelerator, model, step_fn, reference, task, validation, grad_accum, layout)
    if RunPosition.shrunken_copy:  # the shrunken copy's run ends here: its line is the run's
        from .shrunk import ShrunkenChecked

        raise ShrunkenChecked(f"{line}, {RunPosition.shrunken_copy}")
    accelerator.print(line)
