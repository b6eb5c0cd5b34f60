"""--optimizer muon: Muon (momentum orthogonalised by a Newton–Schulz iteration) for the hidden weight
matrices, AdamW for the rest (embeddings, the output head, norms, biases), in one optimizer.

Exact on every layout. Newton–Schulz needs the WHOLE matrix, and under FSDP2 and TP a rank holds a
slice of it (a DTensor). Each step, a cut matrix's update is gathered whole on every rank (an
all-gather: `full_tensor`), orthogonalised there (every rank computes the same bits), and each rank
keeps its own slice (`distribute_tensor(..., src_data_rank=None)`: no communication). A stack of
matrices cut only along the stack (an expert-parallel rank's experts) is orthogonalised where it lies.
This is the simpler of the two ways: every rank repeats the Newton–Schulz work. The other (each matrix
gathered on one owner, round-robin over the ranks, and its slices sent back) splits the work.

Conventions: a matrix's step is 0.2·sqrt(max(A, B)) x --learning_rate (Moonlight's, torch.optim.Muon's
adjust_lr_fn="match_rms_adamw"): its update's RMS is then AdamW's, so one --learning_rate serves both
groups. Decoupled weight decay lr x --weight_decay on the matrices, as AdamW's. Nesterov momentum
--muon_momentum. The iteration runs in fp32: torch.optim.Muon's runs in bf16, whose rounding would
part the layouts by more than 1e-5."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from accelerate import PartialState
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim.adamw import adamw

from .errors import UsageError

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic, as torch.optim.Muon's


def newton_schulz(update: torch.Tensor, steps: int, dtype=torch.float32) -> torch.Tensor:
    """~U V^T of update = U S V^T, each matrix of a stack (the last two dimensions) on its own:
    torch.optim.Muon's iteration, in `dtype`."""
    a, b, c = NS_COEFFICIENTS
    x = update.to(dtype)
    tall = x.size(-2) > x.size(-1)
    x = x.mT if tall else x
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=1e-7)  # spectral norm at most 1
    mm = torch.addmm if x.ndim == 2 else torch.baddbmm
    for _ in range(steps):
        gram = x @ x.mT
        x = mm(x, mm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def cuts_a_matrix(p: DTensor) -> bool:
    """True where a rank holds part of a matrix, not whole matrices of a stack."""
    return any(pl.is_shard() and pl.dim % p.ndim >= p.ndim - 2 for pl in p.placements)


def orthogonalise(update: torch.Tensor, p: torch.Tensor, steps: int) -> torch.Tensor:
    """Newton–Schulz of a parameter's update, laid out as the parameter is."""
    if not isinstance(p, DTensor):
        return newton_schulz(update, steps)
    if not cuts_a_matrix(p):  # whole matrices on this rank: orthogonalised where they lie
        local = newton_schulz(update.redistribute(p.device_mesh, p.placements).to_local(), steps)
        return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    whole = update.full_tensor()  # MUON: the all-gather; every rank gets the whole matrix
    return distribute_tensor(newton_schulz(whole, steps), p.device_mesh, p.placements, src_data_rank=None)


class MuonAdamW(torch.optim.Optimizer):
    """Muon for the groups marked "muon", AdamW (torch's functional adamw) for the others."""

    def __init__(self, param_groups, lr, momentum=0.95, ns_steps=5, betas=(0.9, 0.95), eps=1e-8, **kernels):
        defaults = dict(lr=lr, momentum=momentum, ns_steps=ns_steps, betas=betas, eps=eps, muon=False, **kernels)
        super().__init__(param_groups, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["muon"]:
                for p in params:
                    self.muon_step(p, group)
            elif params:
                self.adamw_step(params, group)
        return loss

    def muon_step(self, p, group) -> None:
        state, momentum = self.state[p], group["momentum"]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad)
        buffer = state["momentum_buffer"]
        buffer.lerp_(p.grad, 1 - momentum)
        update = orthogonalise(p.grad.lerp(buffer, momentum), p, group["ns_steps"])  # Nesterov
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(update.to(p.dtype), alpha=-group["lr"] * 0.2 * math.sqrt(max(p.shape[-2:])))

    def adamw_step(self, params, group) -> None:
        for p in params:
            state = self.state[p]
            if not state:  # torch.optim.AdamW's state, so its checkpoints read the same
                on_device = group.get("fused") and p.device.type != "cpu"
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adamw(
            params,
            [p.grad for p in params],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [],
            [s["step"] for s in states],
            foreach=group.get("foreach"),
            fused=group.get("fused"),
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )


def muon_matrices(model: nn.Module) -> list:
    """The hidden weight matrices Muon takes: every trainable 2-D parameter, and every 3-D one (a stack
    of matrices, as a mixture's experts), except the embeddings' and the output head's (the model's
    `get_output_embeddings()`, 🤗's name, which the built-in GPT has too)."""
    inner = getattr(model, "module", model)  # under DDP, the model it wraps
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    apart = [m for m in inner.modules() if isinstance(m, nn.Embedding)] + ([head] if head is not None else [])
    skip = {id(p) for m in apart for p in m.parameters()}
    return [p for p in model.parameters() if p.requires_grad and p.ndim in (2, 3) and id(p) not in skip]


def make_muon(model: nn.Module, args, groups: dict, kernels: dict) -> MuonAdamW:
    """MuonAdamW on `groups` ({(decay, kind): params}, make_optimizer's), the Muon matrices apart.
    Refuses a model with none (one line); prints which parameter went where."""
    matrices = {id(p) for p in muon_matrices(model)}
    if not matrices:
        raise UsageError(
            "--optimizer muon: the model has no 2-D weight matrix outside its embeddings and output head; "
            "use --optimizer adamw"
        )
    param_groups = []
    for (decay, kind), params in groups.items():
        for muon in (True, False):
            chosen = [p for p in params if (id(p) in matrices) == muon]
            if chosen:
                wd = args.weight_decay if decay else 0.0
                param_groups.append({"params": chosen, "weight_decay": wd, "muon": muon})
    optimizer = MuonAdamW(
        param_groups, lr=args.learning_rate, momentum=args.muon_momentum, ns_steps=args.ns_steps, **kernels
    )
    PartialState().print(muon_line(optimizer))
    return optimizer


def muon_line(optimizer: MuonAdamW) -> str:
    """Which parameters each half of the optimizer holds (counts, values), and what making the cut
    matrices whole costs each rank per step."""
    muon = [p for g in optimizer.param_groups if g["muon"] for p in g["params"]]
    rest = [p for g in optimizer.param_groups if not g["muon"] for p in g["params"]]
    cut = [p for p in muon if isinstance(p, DTensor) and cuts_a_matrix(p)]
    gathered = sum((p.numel() - p.to_local().numel()) * 4 for p in cut)  # fp32 values this rank receives
    whole = (
        f"{len(cut)} cut matrices made whole each step: an all-gather of {gathered / 2**20:.2f} MiB received "
        "by this rank, Newton–Schulz on every rank"
        if cut
        else "no matrix is cut: Newton–Schulz where each lies"
    )
    return (
        f"optimizer: Muon for {len(muon)} matrices ({sum(p.numel() for p in muon):,} values), AdamW for "
        f"{len(rest)} tensors ({sum(p.numel() for p in rest):,} values: embeddings, output head, norms, "
        f"biases); {whole}"
    )


def muon_numel(model: nn.Module) -> int:
    """Values Muon takes (its momentum: 4 bytes each in fp32, where AdamW keeps 8)."""
    return sum(p.numel() for p in muon_matrices(model))
