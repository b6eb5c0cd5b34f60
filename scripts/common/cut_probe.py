"""The cut check's probe (common/cut_check.py's check_cut, in a run that cut the model): one probe step
through the lesson's own step function; the loss and every parameter's gradient (made whole from its
shards) against the uncut copy's on the same samples, in eval mode (no dropout), the RNG untouched. Where
they differ, one more probe step finds the first module, in the cut model's order of execution, whose
output parts from the uncut one's. What it cannot see: layouts whose micro-batches group samples
differently, where a model whose outputs depend on its batch's other samples is refused in its own line."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate.utils import send_to_device
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, _get_fqns, get_model_state_dict
from torch.distributed.tensor import DTensor
from torch.utils.data import default_collate

from .errors import UsageError
from .run_state import RunPosition

PROBE_SAMPLES = 2  # per micro-batch: enough to batch, cheap on any model
RTOL = {"no": 1e-4, "bf16": 5e-2, "fp16": 5e-2}  # of each gradient's largest entry (and of the loss)


def probe_step(task, validation, dp_rank: int, dp_size: int, grad_accum: int, device, size: int = PROBE_SAMPLES):
    """The probe: dp_size x grad_accum micro-batches of `size` validation samples. Returns this rank's
    micro-batches, all of them (for the uncut model), the same samples as one batch, and their target count."""
    samples = [validation[i % len(validation)] for i in range(dp_size * grad_accum * size)]
    micro_batches = [default_collate(samples[i : i + size]) for i in range(0, len(samples), size)]
    n_targets = sum(task.count_targets(mb) for mb in micro_batches)
    mine = micro_batches[dp_rank * grad_accum : (dp_rank + 1) * grad_accum]
    whole = default_collate(samples)
    device_mbs = send_to_device(mine, device)
    return device_mbs, micro_batches, whole, torch.as_tensor(n_targets, device=device)


def _name_of(model: nn.Module, name: str) -> str:
    fqns = _get_fqns(model, name)  # without DDP's `module.`, compile's `_orig_mod.`, checkpoint wrappers
    return next(iter(fqns)) if len(fqns) == 1 else name


def whole_gradients(model: nn.Module, dp_group=None, dp_size: int = 1) -> dict[str, torch.Tensor]:
    """{parameter name: its whole gradient, on the CPU} for what this rank holds: DTensor shards made
    whole (a collective over their mesh); a plain tensor's averaged over the data-parallel ranks, as DDP
    averages them (the same numbers again where DDP did; Local SGD's replicas keep theirs apart)."""
    grads = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        if isinstance(g, DTensor):
            g = g.full_tensor()
        g = g.detach().clone()
        if dp_size > 1 and dist.is_initialized():
            dist.all_reduce(g, group=dp_group)
            g /= dp_size
        grads[_name_of(model, name)] = g.float().cpu()
    return grads


def reference_step(reference, task, micro_batches, whole, n_targets, autocast) -> tuple:
    """The uncut model on every micro-batch of the probe: the loss (global sum / global targets), the
    gradients of that loss, and the loss of the same samples as one batch."""
    reference.zero_grad(set_to_none=True)
    loss_sum = torch.zeros(())
    for mb in micro_batches:
        with autocast():
            mb_loss, _ = task.loss_of(reference, mb)
            (mb_loss / n_targets.cpu()).backward()
        loss_sum += mb_loss.detach().float()
    with torch.no_grad(), autocast():
        whole_loss, _ = task.loss_of(reference, whole)
    grads = {
        n: p.grad.detach().float() if p.grad is not None else torch.zeros_like(p)
        for n, p in reference.named_parameters()
        if p.requires_grad
    }
    return float(loss_sum / n_targets.cpu()), grads, float(whole_loss.float() / n_targets.cpu())


def gap(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(max |a - b|, relative to b's largest entry); inf where shapes differ or a value is not finite."""
    if a.shape != b.shape or not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("inf"), float("inf")
    diff = (a - b).abs().max().item() if a.numel() else 0.0
    return diff, diff / max(b.abs().max().item() if b.numel() else 0.0, 1e-12)


def probe_cut(accelerator, model, step_fn, reference, task, validation, grad_accum: int, layout=None) -> str:
    """Collective. One probe step through `step_fn(micro_batches, n_global_targets)` (the lesson's own
    forward and backward: it returns this rank's loss sum) against `reference`, the data-parallel ranks
    from `layout` (default: every process a replica). What a step may say of itself: `micro_batch_size`,
    the one it takes (a pipeline, whose stages send each other tensors of the run's shape; default 2
    samples); `token_positions`, the sequence positions this rank computes (CP: outputs are compared
    there). Gradients a rank keeps apart from its replicas (Local SGD) are averaged over them, as DDP
    would. Returns the start line; raises UsageError where the cut is not the model. The RNG, the model's
    mode and its gradients are left as they were (no gradients), so the run that follows is the run
    without the check."""
    strategy = Path(sys.argv[0]).name  # the lesson: train_cp.py
    start = time.perf_counter()
    dp_rank, dp_size = (layout.dp_rank, layout.dp) if layout else (accelerator.process_index, accelerator.num_processes)
    device, rtol = accelerator.device, RTOL.get(accelerator.mixed_precision, RTOL["bf16"])
    autocast = _cpu_autocast(accelerator.mixed_precision)
    size = getattr(step_fn, "micro_batch_size", None) or PROBE_SAMPLES
    mine, all_mbs, whole, n_targets = probe_step(task, validation, dp_rank, dp_size, grad_accum, device, size)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), _eval(model), _eval(reference):
        dp_group = layout.group("dp") if layout else None  # None: every process a replica
        cut_loss, cut_grads = _cut_step(accelerator, model, step_fn, mine, n_targets, dp_group, dp_size)
        weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))  # collective
        weights = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu() for k, v in weights.items()}
        reference.load_state_dict(weights, strict=False)  # a pipeline rank holds only its stages' part
        ref_loss, ref_grads, whole_loss = reference_step(reference, task, all_mbs, whole, n_targets, autocast)
        worst, gaps = 0.0, [gap(torch.tensor(cut_loss), torch.tensor(ref_loss))[1]]
        for name, ref in ref_grads.items():
            if name in cut_grads:
                diff, rel = gap(cut_grads[name], ref)
                worst, gaps = max(worst, diff), gaps + [rel if diff > 1e-7 else 0.0]
        # a strategy that made a parameter anew may have made a frozen one train (LoRA's base, frozen experts)
        frozen = {n for n, p in reference.named_parameters() if not p.requires_grad}
        thawed = sorted(n for n in cut_grads if n in frozen)
        parted = torch.tensor([float(max(gaps) > rtol), float(bool(thawed))], device=device)
        if dist.is_initialized():
            dist.all_reduce(parted, op=dist.ReduceOp.MAX)
        if parted[1].item():
            raise UsageError(
                f"{strategy}: the cut model trains what the model freezes ({', '.join(thawed[:3]) or 'on a peer'}): "
                "the strategy made a parameter anew without its requires_grad; keep requires_grad=param.requires_grad"
            )
        if parted[0].item():  # every rank: one more probe step, each module's output against the uncut one's
            first = first_parting(model, step_fn, mine, n_targets, reference, task, all_mbs, dp_rank, grad_accum)
            where = f"at {first[0]} (its output off by {first[1]:.2g})" if first else "in the gradients"
            on = f" ({RunPosition.shrunken_copy})" if RunPosition.shrunken_copy else ""
            raise UsageError(
                f"{strategy}: the cut model does not compute the model{on}: on {len(all_mbs) * size} probe "
                f"samples its loss is {cut_loss:.6g} against {ref_loss:.6g} uncut, and the two first part {where}: "
                f"something there mixes what {strategy} cuts in a way it does not carry; "
                "train it with another strategy (or, knowing the run is wrong, --skip_cut_check)"
            )
    if dp_size > 1 or (layout and layout.cp > 1):  # one process has no other rank to wait for
        from .layer_drop import check_no_layer_drop  # so a run of one does not import it

        check_no_layer_drop(reference, task, all_mbs[0], strategy)
    reference.to_empty(device="meta")  # the copy's memory back to the run
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # the run's peak memory is its own steps'
    batch_gap = gap(torch.tensor(whole_loss), torch.tensor(ref_loss))[1]
    if batch_gap > rtol and not _drops_tokens_by_design(model):
        raise UsageError(
            f"{strategy}: the model's loss depends on which samples share its micro-batch ({whole_loss:.6g} as "
            f"one batch of the probe, {ref_loss:.6g} as micro-batches of {size}, eval mode): a layout "
            "that changes the micro-batch would not be the run on one process; find what mixes samples in the "
            "model's forward (or, knowing the runs differ, --skip_cut_check)"
        )
    return (
        f"cut checked: {strategy}'s step on {len(all_mbs) * size} probe samples = the uncut model's "
        f"(loss |Δ| {abs(cut_loss - ref_loss):.1e}, gradients max |Δ| {worst:.1e}), {time.perf_counter() - start:.1f} s"
    )


@contextmanager
def _eval(model: nn.Module):
    """Eval mode (no dropout) for the probe; no gradients left behind."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)


def _cut_step(accelerator, model, step_fn, micro_batches, n_targets, dp_group, dp_size: int):
    model.zero_grad(set_to_none=True)
    loss = accelerator.reduce(step_fn(micro_batches, n_targets).detach().float(), reduction="sum")
    return float(loss / n_targets), whole_gradients(model, dp_group, dp_size)


def _cpu_autocast(precision: str):
    if precision == "bf16":
        return lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    return lambda: torch.autocast("cpu", enabled=False)


def _drops_tokens_by_design(model: nn.Module) -> bool:
    """--capacity_factor caps each expert per micro-batch: batch-dependent on purpose (docs/ep.md)."""
    return any(getattr(m, "capacity_factor", None) for m in model.modules())


# ---------------------------------------------------------------- where a cut parts from the model
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
        if out.shape == ref.shape and gap(out, ref)[1] > RTOL["no"]:
            return name, gap(out, ref)[0]
    return None
