#!/usr/bin/env python
"""Local SGD and DiLoCo: train apart, fuse the replicas every K steps.

DDP all-reduces the gradients at every step. Local SGD lets every rank take K optimizer steps
on its own data without talking to anyone, then fuses the replicas once:

    rank 0:  step step step step | fuse the  | step step step step | fuse ...
    rank 1:  step step step step | replicas  | step step step step |
             <--- K local steps, no communication --->  one all-reduce (K x fewer bytes than DDP)

Two ways to fuse (--outer_optimizer):
- `average` (Local SGD; 🤗 Accelerate's LocalSGD): the parameters become their average over the ranks.
- `nesterov` (DiLoCo, Douillard et al. 2023): the change since the last fusion is a pseudo-gradient,
      Δ = θ_last − θ_rank,   averaged over the ranks,   θ_last ← OuterSGD(θ_last, mean Δ),
  an SGD step with Nesterov momentum (--outer_lr 0.7, --outer_momentum 0.9), and every rank continues
  from the new θ_last. `average` is the special case lr 1, momentum 0. θ_last is kept in CPU memory.
Streaming DiLoCo (--fragments F) fuses the blocks in F fragments, fragment f at the steps ≡ f·K/F
(mod K): the same bytes, spread over time, so the peak bandwidth is F times lower; --outer_dtype bf16
halves the bytes of the pseudo-gradient all-reduce. Each fusion is ONE all-reduce of a flat buffer.
Overlapped fusions (--overlap_steps τ, Streaming DiLoCo's overlap): the all-reduce runs in the background
while the replicas take τ more inner steps; then the outer step lands, and each replica mixes
    θ_r ← α·θ_r + (1 − α)·θ_last        (--overlap_mix α, 0.5 in the paper)
so a slow link costs no waiting once τ steps take longer than the all-reduce.

What is fused: the parameters, and the running statistics of BatchNorm layers (averaged, as at each
evaluation and checkpoint: common/batchnorm.py). Each rank keeps its own inner (AdamW) optimizer state.
With plain SGD, no clipping and K = 1, `average` IS data parallelism (averaging the parameters after
a linear update equals averaging the gradients); with Adam, or K > 1, the replicas wander apart
between fusions: less communication, bought with some
accuracy per step (benchmarks/bench_localsgd.py measures it).

Each rank divides its loss sum by the target count of the whole global batch, as DDP does: the
count travels one step ahead in a small asynchronous all-reduce that no step waits for. Dividing
by each rank's own count would weight ranks equally rather than tokens, and K = 1 would then not
be DDP whenever samples have different numbers of targets (docs/troubleshooting.md, "Local SGD
with K = 1 differs from DDP").

Run it:
    accelerate launch --config_file accelerate_configs/cpu_multi.yaml scripts/train_localsgd.py \\
        --sync_every 8 --save_rank_models
    accelerate launch --config_file accelerate_configs/cpu_multi.yaml scripts/train_localsgd.py \\
        --outer_optimizer nesterov --sync_every 32 --fragments 2
    python scripts/merge_checkpoints.py runs/localsgd/rank_models/rank_0 runs/localsgd/rank_models/rank_1 \\
        --out runs/fused/model
Lines marked `# Accelerate:` are the library's part; `# Local SGD:` marks what differs from train_ddp.py,
`# DiLoCo:` what the outer optimizer and the fragments add.
"""

import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts run as files: copy common/ beside this file

import torch
from accelerate import DistributedType
from accelerate.utils import DistributedDataParallelKwargs, set_seed

from common.batchnorm import average_running_stats, batchnorm_line, running_stats
from common.checkpoint import (
    check_resume_and_output,
    export_model,
    load_checkpoint,
    load_extra_state,
    record_task,
    save_checkpoint,
)
from common.cli import batch_of_step, build_parser, check_core_args, data_source
from common.collectives import CollectiveCounter
from common.costs import count_parameters, replicated_summary, ring_allreduce_bytes
from common.cut_check import check_cut, uncut_copy
from common.errors import UsageError
from common.evaluation import evaluate
from common.launch import make_accelerator, run_main
from common.loader import make_train_loader
from common.metrics import RunMonitor
from common.sharded import launcher_sharding
from common.task import check_task_contract
from common.training import StepFeed, compile_units, make_optimizer, make_scheduler, restride_buffers, unit_modules


# ======================================== Local SGD and DiLoCo: the strategy
def local_forward_backward(
    accelerator, model, task, micro_batches: list, n_global_targets, dp_size: int
) -> torch.Tensor:
    """Forward and backward of this rank's micro-batches; returns their loss sum. The gradients stay
    local (DDP is kept in no_sync). The loss is normalised by the target count of the whole global
    batch (all micro-batches, all ranks), as in train_ddp.py, and multiplied by dp_size because the
    fusion averages the replicas: K = 1 with plain SGD is then DDP."""
    step_loss_sum = torch.zeros((), device=accelerator.device)
    for mb in micro_batches:
        loss_sum, _ = task.loss_of(model, mb)
        accelerator.backward(loss_sum * dp_size / n_global_targets)  # Accelerate: backward
        step_loss_sum += loss_sum.detach()
    return step_loss_sum


def split_fragments(model, units: list, n_fragments: int) -> list[list[torch.nn.Parameter]]:
    """Streaming DiLoCo's fragments: the units (blocks) cut into n_fragments runs of consecutive
    blocks. The parameters outside every block join the nearest end: those the model registers before
    its blocks (embeddings) the first fragment, those after them (final norm, head) the last."""
    bounds = [round(f * len(units) / n_fragments) for f in range(n_fragments + 1)]
    fragments = [[p for u in units[a:b] for p in u.parameters()] for a, b in zip(bounds, bounds[1:])]
    in_units = {id(p) for fragment in fragments for p in fragment}
    before, after, seen_units = [], [], False
    for p in model.parameters():
        if id(p) in in_units:
            seen_units = True
        else:
            (after if seen_units else before).append(p)
    fragments[0] = before + fragments[0]
    fragments[-1] = fragments[-1] + after
    return fragments


class ReplicaSync:
    """Fuses the replicas: fragment f at the steps ≡ f·K/F (mod K), each fusion ONE all-reduce of
    a flat buffer of the fragment (Accelerate's LocalSGD makes one all-reduce per tensor).

    average:   θ ← mean_r θ_r                                  (Local SGD)
    nesterov:  Δ = θ_last − θ_r;  θ_last ← OuterSGD(θ_last, mean_r Δ);  θ_r ← θ_last   (DiLoCo)
    overlapped (--overlap_steps τ): start() sends Δ at step t; land() at t + τ: θ_r ← α·θ_r + (1 − α)·θ_last

    Every rank computes the same outer step from the same mean Δ, so θ_last and the outer momentum
    are the same everywhere: state_dict() is saved once, by the main process."""

    def __init__(
        self, model, fragments, sync_every, dp_size, outer_optimizer, outer_lr, outer_momentum, outer_dtype,
        overlap_steps=0, overlap_mix=0.0,
    ):  # fmt: skip
        self.fragments, self.sync_every, self.dp_size = fragments, sync_every, dp_size
        self.model = model  # its BatchNorm statistics are averaged with the last fragment (not outer-stepped)
        self.compared = [*fragments[:-1], fragments[-1] + running_stats(model)]  # what the spread compares
        name_of = {id(p): name.removeprefix("module.") for name, p in model.named_parameters()}
        self.names = [[name_of[id(p)] for p in fragment] for fragment in fragments]  # saved with θ_last
        self.outer_optimizer, self.outer_dtype = outer_optimizer, outer_dtype
        self.settings = {"outer_optimizer": outer_optimizer, "sync_every": sync_every, "fragments": len(fragments)}
        self.settings["overlap_steps"] = overlap_steps
        self.settings["overlap_mix"] = overlap_mix if overlap_steps else None  # α only mixes an overlapped fusion
        self.offsets = [f * sync_every // len(fragments) for f in range(len(fragments))]
        self.last_fused = [0] * len(fragments)  # the step of each fragment's last fusion
        self.fusions = [0] * len(fragments)  # this run's fusions of each fragment
        self.fragment_mib = [ring_allreduce_bytes(self.nbytes(fr), dp_size) / 2**20 for fr in fragments]
        self.counter = CollectiveCounter()  # the all-reduces the fusions really make, and their buffers
        # DiLoCo --overlap_steps: the fusion in flight, and the seconds the steps waited for one to arrive
        self.overlap_steps, self.overlap_mix, self.in_flight, self.wait_s = overlap_steps, overlap_mix, None, 0.0
        # its own process group (its own connections): the steps' small collectives never queue behind it
        self.fusion_group = torch.distributed.new_group() if overlap_steps and dp_size > 1 else None
        if outer_optimizer == "nesterov":
            # DiLoCo: θ_last, the parameters at the last fusion, in CPU memory (they wait K steps there)
            self.last = [[p.detach().to("cpu", torch.float32, copy=True) for p in fr] for fr in fragments]
            self.outer = [  # DiLoCo: one outer SGD per fragment (momentum 0: plain SGD; Nesterov needs momentum)
                torch.optim.SGD(last, lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0)
                for last in self.last
            ]

    def nbytes(self, fragment) -> int:
        """Bytes of the fragment's all-reduce buffer."""
        return sum(p.numel() for p in fragment) * torch.empty((), dtype=self.outer_dtype).element_size()

    def due(self, step: int) -> list[int]:
        """The fragments fused after optimizer step `step` (1-based)."""
        if self.dp_size == 1 and self.outer_optimizer == "average":
            return []  # one replica: nothing to average
        return [f for f, offset in enumerate(self.offsets) if step % self.sync_every == offset]

    @torch.no_grad()
    def fuse(self, fragment: int, step: int) -> None:
        """Collective: every rank fuses the same fragment at the same step."""
        if self.outer_optimizer == "nesterov":  # DiLoCo: send the pseudo-gradient, and wait for it at once
            self.start(fragment, step)
            return self.land(mix=0.0)
        params = self.fragments[fragment]
        with self.counter:  # Local SGD: the parameters themselves, averaged
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            if self.dp_size > 1:
                torch.distributed.all_reduce(flat)  # Local SGD: ONE all-reduce (sum) of the flat buffer
                flat /= self.dp_size
        for p, value in zip(params, flat.split([p.numel() for p in params])):
            p.copy_(value.view_as(p))  # every rank continues from the fused parameters
        self.fused(fragment, step)

    def fused(self, fragment: int, step: int) -> None:
        if fragment == len(self.fragments) - 1 and self.dp_size > 1:
            with self.counter:
                average_running_stats(self.model)  # BatchNorm's statistics: averaged, whatever the outer optimizer
        self.last_fused[fragment] = step
        self.fusions[fragment] += 1

    @torch.no_grad()
    def start(self, fragment: int, step: int) -> None:
        """DiLoCo: the pseudo-gradient Δ = θ_last − θ_rank starts its all-reduce (sum); land() waits for it."""
        params, last = self.fragments[fragment], self.last[fragment]
        delta = torch.cat([(t.to(p.device) - p.detach()).reshape(-1) for t, p in zip(last, params)])
        delta = delta.to(self.outer_dtype)
        work = None
        if self.dp_size > 1:
            with self.counter:  # DiLoCo: ONE all-reduce of the flat buffer, in the background if overlapped
                work = torch.distributed.all_reduce(delta, group=self.fusion_group, async_op=True)
        self.in_flight = {"fragment": fragment, "step": step, "work": work, "delta": delta}
        self.fused(fragment, step)

    def arrived(self) -> torch.Tensor:
        """The mean pseudo-gradient of the fusion in flight, once its all-reduce is done (waits if not)."""
        flight = self.in_flight
        if flight["work"] is not None:
            began = time.perf_counter()
            flight["work"].wait()  # DiLoCo: the only place a step waits for a fusion
            self.wait_s += time.perf_counter() - began
            flight["delta"] /= self.dp_size
            flight["work"] = None
        return flight["delta"]

    @torch.no_grad()
    def land(self, mix: float) -> None:
        """DiLoCo: the outer step from the mean pseudo-gradient; each replica becomes mix·θ_r + (1 − mix)·θ_last."""
        fragment, mean_delta = self.in_flight["fragment"], self.arrived().float().cpu()
        last, params = self.last[fragment], self.fragments[fragment]
        for t, g in zip(last, mean_delta.split([t.numel() for t in last])):
            t.grad = g.view_as(t)
        self.outer[fragment].step()  # DiLoCo: the outer SGD (Nesterov) step on θ_last
        for p, t in zip(params, last):  # every rank continues from the fused parameters (mixed, if overlapped)
            if mix == 0:
                p.copy_(t.to(p.device))
            else:
                p.lerp_(t.to(p.device), 1 - mix)  # mix·θ_r + (1 − mix)·θ_last
        self.in_flight = None

    def after_step(self, step: int) -> list[int]:
        """Lands the fusion in flight whose τ steps are done, then fuses (or starts) the fragments due after
        `step`; returns them."""
        if self.in_flight and step == self.in_flight["step"] + self.overlap_steps:
            self.land(self.overlap_mix)
        fused = self.due(step)
        for f in fused:
            self.start(f, step) if self.overlap_steps else self.fuse(f, step)
        return fused

    def finish(self, step: int) -> list[int]:
        """The final fusion: every fragment not fused at `step` (the last step) is fused now."""
        if self.dp_size == 1 and self.outer_optimizer == "average":
            return []
        if self.in_flight:  # started at this step: no inner step since, so no mix (the replicas become one)
            self.land(0.0 if self.in_flight["step"] == step else self.overlap_mix)
        rest = [f for f, last in enumerate(self.last_fused) if last != step]
        for f in rest:
            self.fuse(f, step)
        return rest

    def state_dict(self) -> dict:
        state = {"settings": self.settings, "last_fused": self.last_fused}
        if self.outer_optimizer == "nesterov":
            state |= {"names": self.names, "last": self.last, "outer": [opt.state_dict() for opt in self.outer]}
        if self.in_flight:  # DiLoCo: a fusion in flight is saved arrived, to land at the same step after a resume
            state["in_flight"] = {k: self.in_flight[k] for k in ("fragment", "step")} | {"mean": self.arrived().cpu()}
        return state

    def load_state_dict(self, state: dict | None, path) -> None:
        """Restores θ_last and the outer momentum; refuses a checkpoint of other fusion settings."""
        saved = (state or {}).get("settings", {"outer_optimizer": "average", "sync_every": None, "fragments": 1})
        saved = {"overlap_steps": 0, "overlap_mix": None, **saved}  # older checkpoints record no α
        differ = [k for k in self.settings if saved[k] is not None and saved[k] != self.settings[k]]
        if differ:
            flags = ", ".join(f"--{k} {saved[k]}" for k in differ)
            raise UsageError(
                f"--resume_from_checkpoint {path}: saved with {flags}; resume with the same flags (the outer state "
                "and the fusion steps depend on them)"
            )
        if state is not None:
            self.last_fused = list(state["last_fused"])
        if self.outer_optimizer == "nesterov":
            for mine, saved_last in zip(self.last, state["last"]):
                for t, s in zip(mine, saved_last):
                    t.copy_(s)
            for opt, opt_state in zip(self.outer, state["outer"]):
                opt.load_state_dict(opt_state)
        if (state or {}).get("in_flight"):  # arrived already: land() divides nothing more
            flight = state["in_flight"]
            device = self.fragments[0][0].device
            self.in_flight = {**flight, "work": None, "delta": flight.pop("mean").to(device)}

    @torch.no_grad()
    def continue_from_fusion(self, step: int, saved_replicas: int, path) -> str:
        """A resume on another number of replicas (an elastic restart after a node was lost, or came back):
        the saved replicas cannot map one to one, so every rank continues from θ at the last fusion (DiLoCo's
        θ_last, with its outer momentum); each keeps the inner optimizer state of saved replica r mod N.
        Returns the line that says what was dropped."""
        dropped = max(step - last for last in self.last_fused)  # local steps since a fragment's fusion
        local_steps = f"{dropped} local step{'s' if dropped != 1 else ''}"
        if self.outer_optimizer == "average" and dropped:  # θ at the last fusion is not kept: refuse
            raise UsageError(
                f"--resume_from_checkpoint {path}: saved by {saved_replicas} replicas at step {step}, {local_steps} "
                "after a fusion, and --outer_optimizer average keeps no copy of the fused model: resume on "
                f"{saved_replicas} processes, or from a checkpoint taken at a fusion (--checkpoint_every a multiple "
                "of --sync_every)"
            )
        if self.in_flight:
            self.land(0.0)  # DiLoCo: the outer step of the fusion in flight (its mean was saved)
        if self.outer_optimizer == "nesterov":
            for fragment, last in zip(self.fragments, self.last):
                for p, t in zip(fragment, last):
                    p.copy_(t.to(p.device))  # DiLoCo: every replica from θ_last
        lost = f", dropping the {local_steps} since it" if dropped else " (the checkpoint is at a fusion)"
        return (
            f"{saved_replicas} replicas saved the checkpoint, {self.dp_size} resume it: every replica continues "
            f"from the model of the last fusion (step {step - dropped}){lost}; replica r keeps saved replica "
            f"r mod {saved_replicas}'s inner optimizer state"
        )

    def report(self, steps: int, args, ddp_mib: float) -> dict:
        """What the summary records: the fusion settings, the fusions and the bytes they moved (measured
        calls and buffers; per rank by the ring formula), and what DDP would have sent (`ddp_mib` a step)."""
        fused_mib = sum(self.fragment_mib[f] * n for f, n in enumerate(self.fusions))
        counted = self.counter.report().get("all_reduce", {"calls": 0, "mib": 0.0})
        return {
            "sync_every": args.sync_every,
            "outer_optimizer": args.outer_optimizer,
            "fragments": args.fragments,
            "outer_dtype": args.outer_dtype,
            "overlap_steps": self.overlap_steps,
            "overlap_mix": self.overlap_mix,
            "fusion_wait_s": round(self.wait_s, 3),  # DiLoCo: the steps' time spent waiting for a fusion
            "fusions": sum(self.fusions),
            "fusions_per_fragment": self.fusions,
            "fusion_allreduce_calls": counted["calls"],
            "fusion_allreduce_buffer_mib": round(counted["mib"], 4),
            "fusion_mib_per_rank": round(fused_mib, 4),
            "peak_fusion_mib_per_rank": round(max(self.fragment_mib), 4),
            "allreduce_mib_per_step_per_rank": round(fused_mib / max(1, steps), 5),
            "ddp_allreduce_mib_per_step_per_rank": round(ddp_mib, 4) if self.dp_size > 1 else 0.0,
        }


def save_rank_model(accelerator, model, task, output_dir, data_source: dict) -> None:
    """--save_rank_models: every rank writes its own replica, before the final fusion, for
    merge_checkpoints.py (model fusion after training)."""
    local_state = {k.removeprefix("module."): v.detach().cpu() for k, v in model.state_dict().items()}
    rank_dir = Path(output_dir) / "rank_models" / f"rank_{accelerator.process_index}"
    task.export(local_state, rank_dir, data_source)
    record_task(task, rank_dir)  # a Task of your own: merge_checkpoints.py and evaluate.py find it
    accelerator.print(
        f"each rank's model before the final fusion: {Path(output_dir) / 'rank_models'}/rank_<r> "
        "(fuse them with scripts/merge_checkpoints.py)"
    )


def check_localsgd_flags(args) -> None:
    """The fusion flags, before anything runs: each mistake is one line that names the flag."""
    if args.sync_every < 1:
        raise UsageError(
            f"--sync_every must be at least 1 (got {args.sync_every}): the number of local steps between two fusions"
        )
    if args.fragments < 1 or args.sync_every % args.fragments:
        raise UsageError(
            f"--fragments {args.fragments} must divide --sync_every {args.sync_every}: fragment f is fused at the "
            "steps = f*K/F (mod K); pick F among the divisors of K"
        )
    period = args.sync_every // args.fragments  # the steps between two fusions
    if args.outer_optimizer == "nesterov" and (args.outer_lr <= 0 or not 0 <= args.outer_momentum < 1):
        raise UsageError(
            f"--outer_lr {args.outer_lr} / --outer_momentum {args.outer_momentum}: the outer learning rate must be "
            "above 0 and the momentum in [0, 1) (DiLoCo uses 0.7 and 0.9)"
        )
    if args.overlap_steps and (args.outer_optimizer != "nesterov" or not 0 < args.overlap_steps <= period):
        raise UsageError(
            f"--overlap_steps {args.overlap_steps} must be between 1 and --sync_every / --fragments = {period}, "
            "with --outer_optimizer nesterov: one fusion in flight at a time, landing before the next starts"
        )
    if not 0 <= args.overlap_mix < 1:
        raise UsageError(
            f"--overlap_mix {args.overlap_mix} must be in [0, 1): the share of its own parameters a replica keeps "
            "when an overlapped fusion lands (0: the fused model alone; Streaming DiLoCo uses 0.5)"
        )
    if args.outer_dtype == "bf16" and args.outer_optimizer == "average":
        raise UsageError(
            "--outer_dtype bf16 needs --outer_optimizer nesterov: average sends the parameters themselves, and bf16 "
            "would round them to 3 digits; DiLoCo sends the small pseudo-gradient"
        )


def check_whole_replicas(sharded: str | None = None, distributed_type=DistributedType.NO) -> None:
    """Local SGD averages whole replicas: a sharded strategy (an FSDP or DeepSpeed launch) has none. The
    launcher's flags are checked before the Accelerator exists (on CPU Accelerate would silently drop an FSDP
    config), and the Accelerator's distributed type after."""
    if sharded:
        raise UsageError(
            f"Local SGD averages whole replicas and cannot run under {sharded} (a sharded strategy): launch without "
            "an FSDP/DeepSpeed config, e.g. --config_file accelerate_configs/cpu_multi.yaml"
        )
    if distributed_type not in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
        raise UsageError(
            f"Local SGD averages whole replicas: it cannot run under {distributed_type}; launch without "
            "an FSDP/DeepSpeed config"
        )


def parameter_fingerprint(params) -> torch.Tensor:
    """One number that differs when any parameter differs (a position-weighted sum, in float64)."""
    return sum((i + 1) * p.detach().double().sum() for i, p in enumerate(params))


def replica_spread(accelerator, fragments) -> list[float]:
    """How far apart the replicas are, per fragment: the spread of their fingerprints over the ranks,
    0 right after the fragment's fusion. Collective (one all-gather)."""
    fingerprints = torch.stack([parameter_fingerprint(fr) for fr in fragments]).to(accelerator.device)
    gathered = accelerator.gather(fingerprints.reshape(1, -1))  # Accelerate: all-gather
    return (gathered.max(0).values - gathered.min(0).values).tolist()


def replicas(accelerator, replica_sync: ReplicaSync, fused: list[int]) -> dict:
    """What a train record adds: whether the step ended with a fusion (which fragments), and the spread
    of the replicas (parameters and BatchNorm statistics)."""
    spread = replica_spread(accelerator, replica_sync.compared)
    record = {"fused": bool(fused), "param_spread": max(spread)}
    if len(replica_sync.fragments) > 1:
        record |= {"fused_fragments": fused, "fragment_spread": spread}
    return record


def main():
    # ---------------------------------------- flags
    parser = build_parser(__doc__)
    from common.builtin_flags import add_builtin_flags  # the built-in data sets' and models' flags

    add_builtin_flags(parser)  # data and a model of your own: drop these two lines
    g = parser.add_argument_group("Local SGD")
    g.add_argument(
        "--sync_every", type=int, default=8, help="average the parameters every K optimizer steps (and at the end)"
    )
    g.add_argument(
        "--outer_optimizer",
        choices=["average", "nesterov"],
        default="average",
        help="how a fusion combines the replicas: average the parameters (Local SGD), or an outer SGD step with "
        "Nesterov momentum on the averaged pseudo-gradient (DiLoCo)",
    )
    g.add_argument("--outer_lr", type=float, default=0.7, help="DiLoCo: the outer SGD's learning rate")
    g.add_argument(
        "--outer_momentum", type=float, default=0.9, help="DiLoCo: the outer SGD's Nesterov momentum (0: none)"
    )
    g.add_argument(
        "--fragments",
        type=int,
        default=1,
        help="Streaming DiLoCo: fuse the blocks in F fragments, fragment f at the steps = f*K/F (mod K); "
        "F must divide K and be at most the number of blocks",
    )
    g.add_argument(
        "--outer_dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="dtype of the pseudo-gradient all-reduce (bf16: half the bytes; needs --outer_optimizer nesterov)",
    )
    g.add_argument(
        "--overlap_steps",
        type=int,
        default=0,
        help="DiLoCo: a fusion's all-reduce overlaps the next τ inner steps, then lands (0: every step waits for it; "
        "at most --sync_every / --fragments)",
    )
    g.add_argument(
        "--overlap_mix",
        type=float,
        default=0.5,
        help="DiLoCo with --overlap_steps: a replica keeps this share of its own parameters when a fusion lands "
        "(α; the rest is the fused model)",
    )
    g.add_argument(
        "--save_rank_models",
        action="store_true",
        help="every rank also saves its own model right before the final fusion, to OUTPUT_DIR/rank_models/rank_<r> "
        "(for merge_checkpoints.py)",
    )
    sync_bn = "BatchNorm over the global micro-batch (all ranks; with K = 1 and sgd: DDP); without it, each rank "
    g.add_argument("--sync_batchnorm", action="store_true", help=sync_bn + "normalises its own micro-batch")
    args = parser.parse_args()
    args.output_dir = args.output_dir or "runs/localsgd"
    check_core_args(args)
    check_localsgd_flags(args)  # Local SGD: K, the fragments, the outer optimizer

    # ---------------------------------------- Accelerator and layout
    check_whole_replicas(launcher_sharding())  # Local SGD: no sharded launch (on CPU it would be dropped silently)
    # Accelerate: process group (gloo on CPU, NCCL on GPU), device, mixed precision from the launcher.
    # cpu=True where CUDA is missing: the N processes then join one gloo group (without it, each trains alone).
    # The scheduler counts optimizer steps (step_scheduler_with_optimizer=False), whatever the layout.
    # Local SGD: each replica keeps its own buffers (BatchNorm statistics) until a fusion averages them
    accelerator = make_accelerator(
        args,
        cpu=args.cpu or not torch.cuda.is_available(),
        kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)],  # Local SGD: own buffers
        step_scheduler_with_optimizer=False,
    )
    check_whole_replicas(distributed_type=accelerator.distributed_type)  # Local SGD: no sharded Accelerator
    dp_size = accelerator.num_processes  # Local SGD: every process is a replica, holding the whole model
    grad_accum, global_batch_size = batch_of_step(args, dp_size)  # batch_size x dp_size x accumulation

    # ---------------------------------------- data (checked before anything is written)
    # the built-in data sets (addition, pystdlib, hub, your files), cut to the model's context, in its tokens
    from common.data import load_data
    from common.model import context_length, tokenizer_for

    data = load_data(args, accelerator, context_length(args), tokenizer_for(args))
    train_loader = make_train_loader(data.train, args.batch_size, global_batch_size, args.seed)

    # ---------------------------------------- MODEL: the only lines that name the model (docs/your-model.md)
    set_seed(args.seed)  # Accelerate: the same full model on every rank: init independent of the layout
    # the built-in GPT, or a 🤗 transformers causal LM (--model_name_or_path, --model_config), and its Task:
    # the loss of a micro-batch as (loss_sum, n_targets), the targets it counts, its evaluation and export
    from common.model import language_model

    model, task = language_model(args, data)
    model = model.to(accelerator.device)
    n_params, model_line = count_parameters(model), task.describe(model)
    resume_path, facts = check_resume_and_output(accelerator, args, model, task, global_batch_size)
    reference = uncut_copy(model, task, args.skip_cut_check)  # the model as built: what the cut must compute
    if args.compile:
        compile_units(task.units(model), accelerator)  # each unit, before DDP wraps the model

    # ---------------------------------------- optimizer
    optimizer = make_optimizer(model, args)
    scheduler = make_scheduler(optimizer, args)
    train_sampler = train_loader.sampler

    # ---------------------------------------- Local SGD and DiLoCo: the strategy
    units = unit_modules(task.units(model))  # the blocks: Streaming DiLoCo's fragments are runs of them
    if args.fragments > max(1, len(units)):
        raise UsageError(
            f"--fragments {args.fragments}: the model has {len(units)} blocks, and a fragment holds at least one; "
            f"use --fragments {max(1, len(units))} or fewer"
        )
    if args.sync_batchnorm and dp_size > 1:  # BatchNorm normalises over the global micro-batch
        from common.sync_batchnorm import sync_batchnorm  # imported only by a run that asks for it

        sync_batchnorm(model, accelerator.device)
    fragments = split_fragments(model, units, args.fragments)
    # Accelerate: wraps the model in DistributedDataParallel (kept in no_sync below), moves everything to
    # the device, and shards the loader: rank r takes every dp_size-th micro-batch.
    restride_buffers(model)  # Local SGD: DDP's start-up broadcast refuses a transposed buffer (the same values)
    model, optimizer, train_loader, scheduler = accelerator.prepare(model, optimizer, train_loader, scheduler)
    no_sync = accelerator.no_sync(model)  # Local SGD: DDP never all-reduces the gradients from here on
    no_sync.__enter__()
    replica_sync = ReplicaSync(  # DiLoCo: after prepare, so θ_last is taken from the parameters every rank starts from
        model,
        fragments,
        args.sync_every,
        dp_size,
        args.outer_optimizer,
        args.outer_lr,
        args.outer_momentum,
        torch.bfloat16 if args.outer_dtype == "bf16" else torch.float32,
        args.overlap_steps,  # DiLoCo: the inner steps a fusion's all-reduce overlaps
        args.overlap_mix,
    )

    check_task_contract(task, model, data.validation, accelerator.device)  # one line per mistake, before step 1
    probe_step = partial(local_forward_backward, accelerator, model, task, dp_size=dp_size)  # Local SGD: a probe step
    cut_line = check_cut(accelerator, model, probe_step, reference, task, data.validation, grad_accum)
    progress = load_checkpoint(accelerator, resume_path, model, optimizer, scheduler, replicas=True)  # each its own
    if resume_path:  # DiLoCo: θ_last and the outer momentum, as the checkpoint left them
        replica_sync.load_state_dict(load_extra_state(resume_path), resume_path)
        if progress["world_size"] != dp_size:  # Local SGD: an elastic restart on fewer (or more) replicas
            accelerator.print(replica_sync.continue_from_fusion(progress["step"], progress["world_size"], resume_path))
    feed = StepFeed(
        accelerator,
        train_loader,
        train_sampler,
        global_batch_size,
        grad_accum,
        progress,
        task.count_targets,
    )
    feed.seed_dropout(args.seed)  # dropout: each data-parallel rank its own masks, a resume the same ones
    monitor = RunMonitor(accelerator, args, "train_localsgd", feed, dp_size, global_batch_size)
    ddp_mib = ring_allreduce_bytes(4 * n_params, dp_size) / 2**20  # DDP: fp32 gradients, every step
    method = "DiLoCo" if args.outer_optimizer == "nesterov" else "Local SGD"
    where = f" in {args.fragments} fragments, each" if args.fragments > 1 else ""
    if args.overlap_steps:
        method += f" overlapping each fusion with {args.overlap_steps} steps (mix {args.overlap_mix})"
    fusion_mib = replica_sync.fragment_mib
    fusion_line = (
        f"{method}: fusing every {args.sync_every} steps{where}; {max(fusion_mib):.2f} MiB per fusion and "
        f"rank = {sum(fusion_mib) / args.sync_every:.3f} MiB per step (DDP: {ddp_mib:.2f} MiB per step)"
    )
    bn_line = batchnorm_line(model, dp_size, args.sync_batchnorm)  # BatchNorm: what differs from one process
    monitor.start(task, model_line, n_params, data, [fusion_line, bn_line, cut_line], resume_path)

    # ---------------------------------------- the training loop
    step, last_step = progress["step"], min(args.max_steps, args.stop_at_step or args.max_steps)
    model.train()
    while step < last_step and not feed.preempted:
        with monitor.timed_step():  # training time: the records, evaluations and checkpoints below are not
            micro_batches, n_global_targets = feed.next_step()
            # Local SGD: forward and backward of each micro-batch; the gradients stay on this rank
            loss_sum = local_forward_backward(accelerator, model, task, micro_batches, n_global_targets, dp_size)
            # Local SGD: this replica's own norm (Accelerate's clipping unscales fp16 gradients first)
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm or float("inf"))
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            fused = replica_sync.after_step(step)  # Local SGD: fuse the fragments due at this step

        if monitor.due(step, "train"):
            loss = (accelerator.reduce(loss_sum, reduction="sum") / n_global_targets).item()  # Accelerate: all-reduce
            monitor.train(step, loss, lr, grad_norm, **replicas(accelerator, replica_sync, fused))
        if monitor.due(step, "eval") and step < args.max_steps:  # Local SGD: the last one scores the fused model
            # Local SGD: between fusions each rank scores its share of the samples with its own replica
            monitor.eval(step, evaluate(accelerator, model, task, data.validation, args.eval_batch_size))
        if monitor.due(step, "checkpoint") or feed.preempted:  # Local SGD: every rank saves its own replica
            state = replica_sync.state_dict()  # DiLoCo: θ_last and the outer momentum, the same on every rank
            save_checkpoint(accelerator, args, step, feed, model, optimizer, scheduler, facts, True, extra_state=state)
    feed.close()

    # ---------------------------------------- save
    if args.save_rank_models and step == args.max_steps:  # Local SGD: every rank writes its own, before the fusion
        save_rank_model(accelerator, model, task, args.output_dir, data_source(args))  # Local SGD: for merging
    if step == args.max_steps:  # every rank (it gathers what the model holds); the main process writes
        replica_sync.finish(step)  # Local SGD: the final fusion of every fragment not fused at this step
        result = evaluate(accelerator, model, task, data.validation, args.eval_batch_size)  # Local SGD: fused
        spread = max(replica_spread(accelerator, replica_sync.compared))  # Local SGD: 0, one model
        monitor.eval(step, result, fused_model=True, param_spread=spread)  # Local SGD: the fused model's
        export_model(accelerator, model, task, data_source(args), Path(args.output_dir) / "model")
    no_sync.__exit__(None, None, None)  # Local SGD: the end of DDP's no_sync
    costs = replicated_summary(accelerator, n_params, 0.0)  # Local SGD: no gradient all-reduce, the fusions instead
    fusions = replica_sync.report(step - progress["step"], args, ddp_mib)  # Local SGD: the fusions and their bytes
    monitor.summary(step, preempted=feed.preempted, **costs, **fusions)
    del model, optimizer, scheduler, train_loader, feed, replica_sync  # Local SGD: free DDP's wrapper, every peer there
    accelerator.free_memory()
    accelerator.wait_for_everyone()
    accelerator.end_training()  # Accelerate: closes trackers and destroys the process group


if __name__ == "__main__":
    run_main(main)
