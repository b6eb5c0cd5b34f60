"""--optimizer muon: Muon (momentum orthogonalised by a Newton–Schulz iteration) for the hidden weight
matrices, AdamW for the rest (embeddings, the output head, norms, biases), in one optimizer.

Exact on every layout. Newton–Schulz needs the WHOLE matrix, and under FSDP2 and TP a rank holds a
slice of it (a DTensor). A cut matrix has an owner, dealt round-robin over the ranks that cut it (over
one group flattened from both mesh dimensions where FSDP and TP both cut it): each step its slices are
gathered on the owner, orthogonalised once there, and cut and scattered back, so the Newton–Schulz work
is split, not repeated. Under DDP (`replicas`) the whole matrices are dealt over the replicas, each owner
broadcasting its result. Where no group spans a matrix's two cuts, it is gathered whole on every rank
(`full_tensor`), orthogonalised there, and each rank keeps its slice. A stack of matrices cut only along
the stack (an expert-parallel rank's experts), and a matrix no replica shares (Local SGD, a pipeline
stage), is orthogonalised where it lies.

Conventions: a matrix's step is 0.2·sqrt(max(A, B)) x --learning_rate (Moonlight's, torch.optim.Muon's
adjust_lr_fn="match_rms_adamw"): its update's RMS is then AdamW's, so one --learning_rate serves both
groups. Decoupled weight decay lr x --weight_decay on the matrices, as AdamW's. Nesterov momentum
--muon_momentum. The iteration runs in fp32: torch.optim.Muon's runs in bf16, whose rounding would
part the layouts by more than 1e-5."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from accelerate import PartialState
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
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


def cutting_dims(p: torch.Tensor) -> list[int]:
    """The mesh dimensions (of more than one rank) that cut a matrix of `p`: any placement but Replicate
    and a Shard of a stack's dimension (FSDP beside TP cuts the same dimension twice: _StridedShard)."""
    if not isinstance(p, DTensor):
        return []

    def stack_only(pl) -> bool:
        return type(pl) is Shard and pl.dim % p.ndim < p.ndim - 2

    mesh = p.device_mesh
    return [i for i, pl in enumerate(p.placements) if mesh.size(i) > 1 and not pl.is_replicate() and not stack_only(pl)]


def cuts_a_matrix(p: torch.Tensor) -> bool:
    return bool(cutting_dims(p))


class Deal(NamedTuple):
    """A cut matrix's owner and how its slices make it whole: `dim`, the tensor dimension one mesh dimension
    cuts (the slices' lengths `sizes`, torch.chunk's rule); or, for a matrix cut along two (FSDP beside TP),
    dim None: each rank's values flattened (`sizes` of them), placed by `indices`, the flat positions of
    every rank's values in the matrix (on the owner; None on the others)."""

    group: object
    dim: int | None
    owner: int
    sizes: list
    indices: list | None = None
    whole: bool = False  # a whole matrix on every replica (DDP): its owner orthogonalises it and broadcasts it


def owners(params: list, replicas: int = 1) -> dict:
    """{id(p): Deal} for each cut matrix: dealt round-robin over the ranks that cut it, in parameter order
    (the same on every rank), so each rank orthogonalises 1/N of them. A matrix cut along two mesh dimensions
    (dp_shard x tp) is dealt over one group flattened from both; where the mesh has no such group, it is
    absent (gathered on every rank). Collective on each group: a cut-twice matrix's positions go to its owner.
    `replicas` > 1 (DDP: every process holds the whole model and steps on the same averaged gradients): the
    whole matrices are dealt over all processes too."""
    dealt, plan = {}, {}
    for p in params:
        dims, dim = cutting_dims(p), None
        if not isinstance(p, DTensor):
            if replicas == 1:
                continue
            group = dist.group.WORLD
        elif len(dims) == 1 and type(p.placements[dims[0]]) is Shard:
            group, dim = p.device_mesh.get_group(dims[0]), p.placements[dims[0]].dim % p.ndim
        elif len(dims) < 2 or (group := flattened_group(p, dims)) is None:
            continue
        n = dealt[group] = dealt.get(group, -1) + 1
        owner, size = n % dist.get_world_size(group), dist.get_world_size(group)
        if not isinstance(p, DTensor):
            plan[id(p)] = Deal(group, None, owner, [], whole=True)
        elif dim is not None:
            plan[id(p)] = Deal(group, dim, owner, slice_sizes(p, dim, size))
        else:
            plan[id(p)] = Deal(group, None, owner, *positions(p, group, owner))
    return plan


def flattened_group(p: DTensor, dims: list[int]):
    """One process group over the mesh dimensions `dims` that cut p (DeviceMesh._flatten, as the layout's
    dp_shard_cp), or None where the mesh cannot make one."""
    mesh = p.device_mesh
    names = tuple(mesh.mesh_dim_names[i] for i in dims) if mesh.mesh_dim_names else ()
    try:
        return mesh[names]._flatten("_".join(names)).get_group()
    except (KeyError, RuntimeError, ValueError, NotImplementedError):
        return None


def positions(p: DTensor, group, owner: int) -> tuple[list, list | None]:
    """Each rank's value count, and on the owner the flat positions of each rank's values in the matrix: the
    positions cut as the matrix is (distribute_tensor without communication), then gathered once."""
    whole = torch.arange(p.numel(), device=p.to_local().device).view(p.shape)
    mine = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None).to_local().reshape(-1)
    counts = [torch.zeros(1, dtype=torch.int64, device=mine.device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(counts, torch.tensor([mine.numel()], device=mine.device), group=group)
    sizes = [int(c) for c in counts]
    bucket = [torch.empty(max(sizes), dtype=mine.dtype, device=mine.device) for _ in sizes]
    is_owner = dist.get_rank(group) == owner
    dist.gather(padded(mine, 0, max(sizes)), bucket if is_owner else None, group=group, group_dst=owner)
    return sizes, [b[:n] for b, n in zip(bucket, sizes, strict=True)] if is_owner else None


def slice_sizes(p: DTensor, dim: int, n: int) -> list[int]:
    """The lengths along `dim` of the n slices a Shard placement cuts (torch.chunk's rule)."""
    sizes = [len(c) for c in torch.arange(p.shape[dim]).chunk(n)]  # chunk may make fewer than n
    return sizes + [0] * (n - len(sizes))


def padded(t: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    pad = [0, 0] * (t.ndim - 1 - dim) + [0, length - t.size(dim)]
    return torch.nn.functional.pad(t, pad).contiguous()


def orthogonalise_all(pairs: list, plan: dict, steps: int) -> list:
    """Newton–Schulz of each (parameter, this rank's part of its update), as this rank's part. A cut matrix:
    its slices gathered on its owner, orthogonalised there, the owner's result cut and scattered back
    (round-robin: the work split over the ranks). DDP's whole matrices: orthogonalised by their owner and
    broadcast. Cut along two where no group spans both: gathered on every rank (all-gather), orthogonalised
    everywhere, each rank keeping its slice. Whole and unshared: where it lies."""
    results, gathers, scatters, broadcasts = [None] * len(pairs), [], [], []
    for i, (p, update) in enumerate(pairs):
        if id(p) in plan and plan[id(p)].whole:  # MUON: DDP's replicas: the owner's result, broadcast
            deal = plan[id(p)]
            is_owner = dist.get_rank(deal.group) == deal.owner
            # contiguous: a tall matrix's result comes transposed, and a broadcast sends its storage order
            results[i] = newton_schulz(update, steps).contiguous() if is_owner else torch.empty_like(update).float()
            broadcasts.append(dist.broadcast(results[i], group=deal.group, group_src=deal.owner, async_op=True))
        elif not cuts_a_matrix(p):  # whole matrices (or a stack's) on this rank: orthogonalised where they lie
            results[i] = newton_schulz(update, steps)
        elif id(p) in plan:  # MUON: 1. every slice to the matrix's owner (gather)
            deal = plan[id(p)]
            flat = deal.dim is None  # cut along two: this rank's values, flattened
            mine = padded(update.reshape(-1) if flat else update, deal.dim or 0, max(deal.sizes))
            bucket = [torch.empty_like(mine) for _ in deal.sizes] if dist.get_rank(deal.group) == deal.owner else None
            work = dist.gather(mine, bucket, group=deal.group, group_dst=deal.owner, async_op=True)
            gathers.append((i, bucket, work))
        else:  # MUON: cut along two mesh dimensions: the all-gather; every rank gets the whole matrix
            cut = DTensor.from_local(update, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            whole = newton_schulz(cut.full_tensor(), steps)
            results[i] = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None).to_local()
    for i, bucket, work in gathers:
        work.wait()
        p, update = pairs[i]
        deal, pieces = plan[id(p)], None
        if bucket is not None:  # MUON: 2. the owner orthogonalises the whole matrix, cuts it again
            pieces = [padded(t, deal.dim or 0, max(deal.sizes)) for t in cut_again(p, deal, bucket, steps)]
        out = torch.empty(mine_shape(update, deal), dtype=torch.float32, device=update.device)
        work = dist.scatter(out, pieces, group=deal.group, group_src=deal.owner, async_op=True)
        scatters.append((i, out, work))
    for i, out, work in scatters:  # MUON: 3. each rank receives its slice
        work.wait()
        p, update = pairs[i]
        deal = plan[id(p)]
        n = deal.sizes[dist.get_rank(deal.group)]
        results[i] = out.narrow(deal.dim or 0, 0, n).view(update.shape)
    for work in broadcasts:
        work.wait()
    return results


def mine_shape(update: torch.Tensor, deal: Deal) -> tuple:
    """The shape of a padded slice (what the gather and the scatter move)."""
    if deal.dim is None:
        return (max(deal.sizes),)
    return tuple(max(deal.sizes) if d == deal.dim else n for d, n in enumerate(update.shape))


def cut_again(p: DTensor, deal: Deal, bucket: list, steps: int) -> list:
    """On the owner: the gathered slices made whole, orthogonalised, and cut again as they came."""
    if deal.dim is not None:
        whole = torch.cat([b.narrow(deal.dim, 0, n) for b, n in zip(bucket, deal.sizes, strict=True)], deal.dim)
        return list(newton_schulz(whole, steps).split(deal.sizes, deal.dim))
    values = torch.cat([b[:n] for b, n in zip(bucket, deal.sizes, strict=True)]).float()
    whole = torch.empty(p.numel(), dtype=torch.float32, device=values.device)
    whole[torch.cat(deal.indices)] = values  # each rank's values where they lie in the matrix
    result = newton_schulz(whole.view(p.shape), steps).reshape(-1)
    return [result[where] for where in deal.indices]


class MuonAdamW(torch.optim.Optimizer):
    """Muon for the groups marked "muon", AdamW (torch's functional adamw) for the others."""

    def __init__(self, param_groups, lr, momentum=0.95, ns_steps=5, betas=(0.9, 0.95), eps=1e-8, replicas=1, **kernels):
        defaults = dict(lr=lr, momentum=momentum, ns_steps=ns_steps, betas=betas, eps=eps, muon=False, **kernels)
        super().__init__(param_groups, defaults)
        self.plan = owners([p for g in self.param_groups if g["muon"] for p in g["params"]], replicas)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["muon"] and params:
                self.muon_step(params, group)
            elif params:
                self.adamw_step(params, group)
        return loss

    def muon_step(self, params, group) -> None:
        """On this rank's parts (a DTensor's local tensor): elementwise, but for Newton–Schulz."""
        momentum, updates = group["momentum"], []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)  # laid out as the parameter
            grad = p.grad
            if isinstance(p, DTensor) and grad.placements != p.placements:
                grad = grad.redistribute(p.device_mesh, p.placements)
            grad, buffer = local(grad), local(state["momentum_buffer"])
            buffer.lerp_(grad, 1 - momentum)
            updates.append((p, grad.lerp(buffer, momentum)))  # Nesterov
        for p, update in zip(params, orthogonalise_all(updates, self.plan, group["ns_steps"]), strict=True):
            weight = local(p)
            weight.mul_(1 - group["lr"] * group["weight_decay"])
            weight.add_(update.to(p.dtype), alpha=-group["lr"] * 0.2 * math.sqrt(max(p.shape[-2:])))

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


def make_muon(model: nn.Module, args, groups: dict, kernels: dict, replicas: int = 1) -> MuonAdamW:
    """MuonAdamW on `groups` ({(decay, kind): params}, make_optimizer's), the Muon matrices apart; the whole
    matrices dealt over `replicas` processes that step alike (DDP). Refuses a model with none (one line);
    prints which parameter went where."""
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
    hyper = dict(lr=args.learning_rate, momentum=args.muon_momentum, ns_steps=args.ns_steps, replicas=replicas)
    optimizer = MuonAdamW(param_groups, **hyper, **kernels)
    PartialState().print(muon_line(optimizer))
    return optimizer


def muon_line(optimizer: MuonAdamW) -> str:
    """Which parameters each half of the optimizer holds (counts, values), and what making the cut
    matrices whole costs each rank per step."""
    muon = [p for g in optimizer.param_groups if g["muon"] for p in g["params"]]
    rest = [p for g in optimizer.param_groups if not g["muon"] for p in g["params"]]
    cut = [p for p in muon if cuts_a_matrix(p)]
    dealt = {id(p) for p in cut if id(p) in optimizer.plan}
    shared = [p for p in muon if id(p) in optimizer.plan and optimizer.plan[id(p)].whole]  # DDP's replicas'
    owned = {id(p) for p in shared if dist.get_rank(optimizer.plan[id(p)].group) == optimizer.plan[id(p)].owner}
    mine = {i for i in dealt if dist.get_rank(optimizer.plan[i].group) == optimizer.plan[i].owner}

    def gathered(p) -> int:  # what a gather makes whole: the matrix, or this rank's experts' (a stack cut twice)
        dim, held = optimizer.plan[id(p)].dim if id(p) in dealt else None, local(p).shape
        if dim is None:
            return p.numel()  # cut along two mesh dimensions: all of it
        return math.prod(held[:dim]) * p.shape[dim] * math.prod(held[dim + 1 :])

    received = sum(  # fp32 values: an owner gets the other slices, the others their slice back
        4 * (local(p).numel() if id(p) in dealt and id(p) not in mine else gathered(p) - local(p).numel()) for p in cut
    )
    whole = (
        f"{len(cut)} cut matrices made whole each step ({len(dealt)} dealt round-robin, this rank "
        f"orthogonalising {len(mine)}; {len(cut) - len(dealt)} cut twice, gathered on every rank): "
        f"{received / 2**20:.2f} MiB received by this rank"
        if cut
        else "no matrix is cut: Newton–Schulz where each lies"
    )
    if shared:  # DDP: every replica would orthogonalise every matrix; each does its share, and broadcasts it
        replicas = dist.get_world_size(optimizer.plan[id(shared[0])].group)
        mib = sum(4 * p.numel() for p in shared if id(p) not in owned) / 2**20
        whole = (
            f"no matrix is cut; {len(shared)} whole matrices dealt round-robin over the {replicas} replicas, this "
            f"rank orthogonalising {len(owned)} and broadcasting them: {mib:.2f} MiB received by this rank"
        )

    def held(params, states: int) -> str:  # the optimizer state this rank holds for them
        mib = sum(states * local(p).numel() * p.element_size() for p in params) / 2**20
        return f"{sum(p.numel() for p in params):,} values, state {mib:.2f} MiB on this rank"

    return (
        f"optimizer: Muon for {len(muon)} matrices ({held(muon, 1)}: the momentum), AdamW for {len(rest)} "
        f"tensors ({held(rest, 2)}: embeddings, output head, norms, biases); {whole}"
    )


def local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def muon_numel(model: nn.Module) -> int:
    """Values Muon takes (its momentum: 4 bytes each in fp32, where AdamW keeps 8)."""
    return sum(p.numel() for p in muon_matrices(model))
