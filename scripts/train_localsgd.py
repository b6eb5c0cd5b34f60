#!/usr/bin/env python
"""Local SGD and DiLoCo: train apart, fuse the replicas every K steps.

DDP all-reduces the gradients at every step. Local SGD lets every rank take K optimizer steps
on its own data without talking to anyone, then fuses the replicas once:

    rank 0:  step step step step | fuse the  | step step step step | fuse ...
    rank 1:  step step step step | replicas  | step step step step |
             <--- K local steps, no communication --->  one all-reduce (K x fewer bytes than DDP)

Two ways to fuse (--outer_optimizer):
- `average` (Local SGD; 🤗 Accelerate's LocalSGD): the parameters become their average over ranks.
- `nesterov` (DiLoCo, Douillard et al. 2023): the change since the last fusion is a pseudo-gradient,
      Δ = θ_last − θ_rank,   averaged over the ranks,   θ_last ← OuterSGD(θ_last, mean Δ),
  an SGD step with Nesterov momentum (--outer_lr 0.7, --outer_momentum 0.9), and every rank
  continues from the new θ_last. `average` is the special case lr 1, momentum 0. θ_last is on CPU.
Streaming DiLoCo (--fragments F) fuses the blocks in F fragments, fragment f at the steps ≡ f·K/F
(mod K): the same bytes, spread over time, so the peak bandwidth is F times lower; --outer_dtype
bf16 halves the bytes of the pseudo-gradient. Each fusion is ONE all-reduce of a flat buffer.
Overlapped fusions (--overlap_steps τ, Streaming DiLoCo's overlap): the all-reduce runs in the
background while the replicas take τ more inner steps; then the outer step lands, and each replica
mixes  θ_r ← α·θ_r + (1 − α)·θ_last  (--overlap_mix α, 0.5 in the paper), so a slow link costs no
waiting once τ steps take longer than the all-reduce.

What is fused: the parameters and BatchNorm's running statistics; each rank keeps its own inner
(AdamW) optimizer state. With plain SGD, no clipping and K = 1, `average` IS data parallelism (the
mean of linear updates is the update of the mean gradient; docs/troubleshooting.md, "Local SGD with
K = 1 differs from DDP"); with Adam, or K > 1, the replicas drift apart: fewer bytes, less accuracy.

Run it:
    accelerate launch --config_file accelerate_configs/cpu_multi.yaml scripts/train_localsgd.py \\
        --sync_every 8 --save_rank_models
    accelerate launch --config_file accelerate_configs/cpu_multi.yaml scripts/train_localsgd.py \\
        --outer_optimizer nesterov --sync_every 32 --fragments 2
    python scripts/merge_checkpoints.py runs/localsgd/rank_models/rank_* --out runs/fused/model
Lines marked `# Accelerate:` are the library's part; the rest is plain PyTorch.
`# Local SGD:` marks what differs from train_ddp.py, `# DiLoCo:` what the outer optimizer and the
fragments add. Below the lesson, in common/: the refusals (localsgd_checks.py), the start line and
summary (localsgd_costs.py), the record of the fusions a checkpoint keeps (localsgd_state.py).
"""

import sys
import time
from functools import partial
from pathlib import Path

# scripts run as files: copy common/ beside this file
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from accelerate.utils import DistributedDataParallelKwargs, set_seed

from common.batchnorm import average_running_stats, batchnorm_line
from common.checkpoint import export_model, load_checkpoint, save_checkpoint, start_point
from common.cli import batch_of_step, build_parser, check_core_args, data_source
from common.contract_check import check_task_contract
from common.costs import count_parameters
from common.cut_check import check_cut, uncut_copy
from common.evaluation import evaluate
from common.launch import make_accelerator, record_peers, run_main
from common.loader import make_train_loader
from common.localsgd_checks import check_fragments_fit, check_localsgd_flags, check_whole_replicas
from common.localsgd_costs import fusion_line, localsgd_summary, replica_spread, replicas
from common.localsgd_state import FusionRecord, save_rank_model
from common.metrics import RunMonitor
from common.output_checks import check_resume_and_output, trial_checkpoint
from common.training import StepFeed, compile_units, make_optimizer, make_scheduler, restride_buffers, unit_modules


# ======================================== Local SGD and DiLoCo: the strategy
def local_forward_backward(accelerator, model, task, micro_batches, n_global_targets, dp_size):
    """Local SGD's step: forward and backward of this rank's micro-batches, and no communication:
    each replica trains alone (DDP is kept in no_sync), and the fusions join them every K steps.
    Returns the loss sum. The loss is divided by the target count of the GLOBAL batch (all
    micro-batches, all ranks), not this rank's, and multiplied by dp_size because a fusion averages
    the replicas: K = 1 with plain SGD is then DDP, step for step."""
    step_loss_sum = torch.zeros((), device=accelerator.device)
    for mb in micro_batches:
        loss_sum, _ = task.loss_of(model, mb)
        accelerator.backward(loss_sum * dp_size / n_global_targets)  # Accelerate: backward
        step_loss_sum += loss_sum.detach()
    return step_loss_sum


def split_fragments(model, units, n_fragments: int) -> list[list[torch.nn.Parameter]]:
    """Streaming DiLoCo's fragments: the blocks (the model's repeated `units`) cut into n_fragments
    runs; the parameters outside the blocks join the nearest end (embeddings the first fragment,
    final norm and head the last). One fragment (the default): every trained parameter."""
    units = unit_modules(units)
    check_fragments_fit(n_fragments, units)  # at most one fragment per block
    bounds = [round(f * len(units) / n_fragments) for f in range(n_fragments + 1)]
    runs = [units[a:b] for a, b in zip(bounds, bounds[1:])]
    fragments = [[p for u in run for p in u.parameters() if p.requires_grad] for run in runs]
    in_units = {id(p) for fragment in fragments for p in fragment}
    trained = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters, not the base
    first = next((i for i, p in enumerate(trained) if id(p) in in_units), len(trained))
    outside = [(i, p) for i, p in enumerate(trained) if id(p) not in in_units]
    fragments[0] = [p for i, p in outside if i < first] + fragments[0]
    fragments[-1] = fragments[-1] + [p for i, p in outside if i > first]
    return fragments


class ReplicaSync:
    """Fuses the replicas as the docstring at the top says: fragment f at the steps ≡ f·K/F (mod K),
    each fusion ONE all-reduce of a flat buffer of the fragment (Accelerate's LocalSGD makes one per
    tensor). average: fuse(); DiLoCo: start() sends Δ, land() takes the outer step (τ steps later if
    overlapped); finish(): the final fusion. Its record (a FusionRecord, common/localsgd_state.py)
    notes each fusion's step and bytes, and is what a checkpoint keeps (state_dict, resume)."""

    def __init__(self, model, fragments: list, dp_size: int, args):  # args: the fusion's flags
        self.model, self.fragments, self.dp_size = model, fragments, dp_size
        self.sync_every, self.outer_optimizer = args.sync_every, args.outer_optimizer
        self.overlap_steps, self.overlap_mix = args.overlap_steps, args.overlap_mix
        self.outer_dtype = torch.bfloat16 if args.outer_dtype == "bf16" else torch.float32
        self.offsets = [f * self.sync_every // len(fragments) for f in range(len(fragments))]
        self.in_flight = None  # DiLoCo --overlap_steps: the fusion whose all-reduce runs meanwhile
        # its own process group: the steps' small collectives never queue behind its all-reduce
        self.fusion_group = torch.distributed.new_group() if self.overlap_steps and dp_size > 1 else None
        self.last = self.outer = None
        if self.outer_optimizer == "nesterov":  # DiLoCo: θ_last, the parameters at the last fusion
            self.last = [[p.detach().to("cpu", torch.float32, copy=True) for p in fr] for fr in fragments]
            momentum = args.outer_momentum  # 0: plain SGD; one SGD per fragment
            outer_sgd = partial(torch.optim.SGD, lr=args.outer_lr, momentum=momentum, nesterov=momentum > 0)
            self.outer = [outer_sgd(last) for last in self.last]
        # the fusions' steps, counts, bytes, waits; a checkpoint keeps it, θ_last and the outer SGDs
        self.record = FusionRecord(args, model, fragments, self.last, self.outer)

    @torch.no_grad()
    def fuse(self, fragment: int, step: int) -> None:
        """Collective: every rank fuses the same fragment at the same step."""
        if self.outer_optimizer == "nesterov":  # DiLoCo: send Δ, and wait for it at once
            self.start(fragment, step)
            return self.land(mix=0.0)
        params = self.fragments[fragment]
        with self.record.counter:  # Local SGD: the parameters themselves, averaged
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            if self.dp_size > 1:
                torch.distributed.all_reduce(flat)  # Local SGD: ONE all-reduce (sum)
                flat /= self.dp_size
        for p, value in zip(params, flat.split([p.numel() for p in params])):
            p.copy_(value.view_as(p))  # every rank continues from the fused parameters
        self.fused(fragment, step)

    @torch.no_grad()
    def start(self, fragment: int, step: int) -> None:
        """DiLoCo: Δ = θ_last − θ_rank starts its all-reduce (sum); land() waits for it."""
        params, last = self.fragments[fragment], self.last[fragment]
        delta = torch.cat([(t.to(p.device) - p.detach()).reshape(-1) for t, p in zip(last, params)])
        delta = delta.to(self.outer_dtype)
        work = None
        if self.dp_size > 1:
            with self.record.counter:  # DiLoCo: ONE all-reduce, in the background if overlapped
                work = torch.distributed.all_reduce(delta, group=self.fusion_group, async_op=True)
        self.in_flight = {"fragment": fragment, "step": step, "work": work, "delta": delta}
        self.fused(fragment, step)

    def fused(self, fragment: int, step: int) -> None:
        """After a fusion of `fragment`: with the last fragment, BatchNorm's running statistics are
        averaged too (a collective); the record notes the fusion's step."""
        if fragment == len(self.fragments) - 1 and self.dp_size > 1:
            with self.record.counter:  # BatchNorm's statistics: with the last fragment, always
                average_running_stats(self.model)
        self.record.fused(fragment, step)

    def arrived(self) -> torch.Tensor:
        """The mean Δ of the fusion in flight, once its all-reduce is done (waits if not)."""
        flight = self.in_flight
        if flight["work"] is not None:
            began = time.perf_counter()
            flight["work"].wait()  # DiLoCo: the only place a step waits for a fusion
            self.record.wait_s += time.perf_counter() - began
            flight["delta"] /= self.dp_size
            flight["work"] = None
        return flight["delta"]

    @torch.no_grad()
    def land(self, mix: float) -> None:
        """DiLoCo: the outer step on the mean Δ; each replica becomes mix·θ_r + (1 − mix)·θ_last."""
        fragment, mean_delta = self.in_flight["fragment"], self.arrived().float().cpu()
        last, params = self.last[fragment], self.fragments[fragment]
        for t, g in zip(last, mean_delta.split([t.numel() for t in last])):
            t.grad = g.view_as(t)
        self.outer[fragment].step()  # DiLoCo: the outer SGD (Nesterov) step on θ_last
        for p, t in zip(params, last):  # every rank continues from the fused parameters
            if mix == 0:
                p.copy_(t.to(p.device))
            else:
                p.lerp_(t.to(p.device), 1 - mix)  # overlapped: mix·θ_r + (1 − mix)·θ_last
        self.in_flight = None

    def after_step(self, step: int) -> list[int]:
        """Lands the fusion in flight whose τ steps are done, then fuses (or starts) the fragments
        due after optimizer step `step` (1-based); returns them."""
        if self.in_flight and step == self.in_flight["step"] + self.overlap_steps:
            self.land(self.overlap_mix)
        if self.dp_size == 1 and self.outer_optimizer == "average":
            return []  # one replica: nothing to average
        fused = [f for f, offset in enumerate(self.offsets) if step % self.sync_every == offset]
        for f in fused:
            self.start(f, step) if self.overlap_steps else self.fuse(f, step)
        return fused

    def finish(self, step: int) -> None:
        """The final fusion, one model: the fusion in flight lands, and every fragment not fused at
        `step` (the last step) is fused now."""
        if self.dp_size == 1 and self.outer_optimizer == "average":
            return  # one replica: nothing to average
        if self.in_flight:  # started at this step: no inner step since, so no mix (one model)
            self.land(0.0 if self.in_flight["step"] == step else self.overlap_mix)
        for f in [f for f, last in enumerate(self.record.last_fused) if last != step]:
            self.fuse(f, step)

    def state_dict(self) -> dict:
        """What a checkpoint keeps (the record); a fusion in flight is waited for and saved arrived,
        to land at the same step after a resume."""
        if self.in_flight:
            self.arrived()
        return self.record.state_dict(self.in_flight)

    @torch.no_grad()
    def resume(self, accelerator, resume_path, progress: dict) -> None:
        """After load_checkpoint: the record, θ_last, the outer momentum and a fusion in flight as
        the checkpoint left them. On another number of replicas (an elastic restart on fewer, or
        more) the saved replicas cannot map one to one: every one continues from the last fusion."""
        if not resume_path:
            return
        self.in_flight = self.record.restore(resume_path, self.fragments[0][0].device)  # or refuses
        if progress["world_size"] != self.dp_size:  # average between fusions: refused (no θ_last)
            saved_at, saved_replicas = progress["step"], progress["world_size"]
            line = self.record.continue_line(saved_at, saved_replicas, self.dp_size, resume_path)
            if self.in_flight:
                self.land(0.0)  # DiLoCo: the outer step of the fusion in flight (its mean saved)
            for fragment, last in zip(self.fragments, self.last or []):
                for p, t in zip(fragment, last):
                    p.copy_(t.to(p.device))  # DiLoCo: every replica from θ_last
            accelerator.print(line)


SYNC_BATCHNORM_HELP = (
    "BatchNorm over the global micro-batch (all ranks; with K = 1 and sgd: DDP); without it, "
    "each rank normalises its own micro-batch"
)


def main():
    # ---------------------------------------- flags
    parser = build_parser(__doc__)
    from common.builtin_flags import add_builtin_flags  # the built-in data sets' and models' flags

    add_builtin_flags(parser)  # data and a model of your own: drop these two lines
    g = parser.add_argument_group("Local SGD")  # Local SGD: K, the outer optimizer, the fragments
    every = "fuse the replicas every K optimizer steps (and at the end)"
    g.add_argument("--sync_every", type=int, default=8, help=every)
    outer = "how a fusion combines the replicas: average the parameters (Local SGD), or an outer "
    outer += "SGD step with Nesterov momentum on the averaged pseudo-gradient (DiLoCo)"
    g.add_argument("--outer_optimizer", choices=["average", "nesterov"], default="average", help=outer)
    g.add_argument("--outer_lr", type=float, default=0.7, help="DiLoCo: the outer SGD's learning rate")
    momentum = "DiLoCo: the outer SGD's Nesterov momentum (0: none)"
    g.add_argument("--outer_momentum", type=float, default=0.9, help=momentum)
    split = "Streaming DiLoCo: fuse the blocks in F fragments, fragment f at the steps = f*K/F "
    split += "(mod K); F must divide K and be at most the number of blocks"
    g.add_argument("--fragments", type=int, default=1, help=split)
    dtype = "dtype of the pseudo-gradient all-reduce (bf16: half the bytes; needs "
    dtype += "--outer_optimizer nesterov)"
    g.add_argument("--outer_dtype", choices=["fp32", "bf16"], default="fp32", help=dtype)
    overlap = "DiLoCo: a fusion's all-reduce overlaps the next τ inner steps, then lands (0: every "
    overlap += "step waits for it; at most --sync_every / --fragments)"
    g.add_argument("--overlap_steps", type=int, default=0, help=overlap)
    mix = "DiLoCo with --overlap_steps: a replica keeps this share of its own parameters when a "
    mix += "fusion lands (α; the rest is the fused model)"
    g.add_argument("--overlap_mix", type=float, default=0.5, help=mix)
    own = "every rank also saves its own model right before the final fusion, to "
    own += "OUTPUT_DIR/rank_models/rank_<r> (for merge_checkpoints.py)"
    g.add_argument("--save_rank_models", action="store_true", help=own)
    g.add_argument("--sync_batchnorm", action="store_true", help=SYNC_BATCHNORM_HELP)
    args = parser.parse_args()
    args.output_dir = args.output_dir or "runs/localsgd"
    check_core_args(args)
    check_localsgd_flags(args)  # Local SGD: K, the fragments, the outer optimizer, the launch

    # ---------------------------------------- Accelerator and layout
    # Accelerate: process group (gloo on CPU, NCCL on GPU), device, mixed precision (launcher).
    # cpu=True where CUDA is missing: the N processes then join one gloo group (else each
    # trains alone). The scheduler counts optimizer steps, whatever the layout.
    accelerator = make_accelerator(
        args,
        cpu=args.cpu or not torch.cuda.is_available(),
        # Local SGD: each replica keeps its own buffers (BatchNorm statistics) until a fusion
        kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)],
        step_scheduler_with_optimizer=False,
    )
    record_peers(accelerator)  # guard: peer records
    check_whole_replicas(accelerator.distributed_type)  # Local SGD: no sharded Accelerator
    dp_size = accelerator.num_processes  # Local SGD: every process is a replica of the whole model
    grad_accum, global_batch_size = batch_of_step(args, dp_size)  # the processes that joined

    # ---------------------------------------- data (checked before anything is written)
    # the built-in data sets (addition, pystdlib, hub, your files) in the model's context and tokens
    from common.data import load_data
    from common.model import context_length, tokenizer_for

    data = load_data(args, accelerator, context_length(args), tokenizer_for(args))
    train_loader = make_train_loader(data.train, args.batch_size, global_batch_size, args.seed)

    # ---------------------------------------- MODEL: the only lines that name the model
    set_seed(args.seed)  # Accelerate: the same full model on every rank, whatever the layout
    # the built-in GPT or a 🤗 causal LM (--model_name_or_path, --model_config), and its Task: a
    # micro-batch's (loss_sum, n_targets), its evaluation and export (docs/your-model.md)
    from common.model import language_model

    model, task = language_model(args, data)
    model = model.to(accelerator.device)
    n_params, model_line = count_parameters(model), task.describe(model)
    resume_path, facts = start_point(accelerator, args, model, task, global_batch_size)
    check_resume_and_output(accelerator, args, resume_path, facts)  # guard: output lock
    reference = uncut_copy(model, task, args.skip_cut_check)  # guard: cut check
    if args.compile:
        compile_units(task.units(model), accelerator)  # each unit, before DDP wraps the model

    # ---------------------------------------- optimizer
    optimizer = make_optimizer(model, args)
    scheduler = make_scheduler(optimizer, args)
    train_sampler = train_loader.sampler

    # ---------------------------------------- Local SGD and DiLoCo: the strategy
    # Accelerate: wraps the model in DistributedDataParallel (kept in no_sync below), moves
    # everything to the device, and shards the loader: rank r takes every dp_size-th micro-batch.
    if args.sync_batchnorm and dp_size > 1:  # BatchNorm normalises over the global micro-batch
        from common.sync_batchnorm import sync_batchnorm  # imported only by a run that asks for it

        sync_batchnorm(model, accelerator.device)
    fragments = split_fragments(model, task.units(model), args.fragments)  # DiLoCo: runs of blocks
    restride_buffers(model)  # DDP: its broadcast of the buffers refuses a transposed one
    model, optimizer, train_loader, scheduler = accelerator.prepare(model, optimizer, train_loader, scheduler)
    no_sync = accelerator.no_sync(model)  # Local SGD: DDP never all-reduces the gradients
    no_sync.__enter__()
    replica_sync = ReplicaSync(model, fragments, dp_size, args)  # DiLoCo: θ_last, once prepared
    check_task_contract(task, model, data.validation, accelerator.device)  # guard: contract
    probe_step = partial(local_forward_backward, accelerator, model, task, dp_size=dp_size)
    check_cut(accelerator, model, probe_step, reference, task, data.validation, grad_accum)  # guard: cut check
    progress = load_checkpoint(accelerator, resume_path, model, optimizer, scheduler, replicas=True)
    trial_checkpoint(accelerator, args, facts, model, optimizer, scheduler, True)  # guard: trial
    replica_sync.resume(accelerator, resume_path, progress)  # DiLoCo: θ_last, the outer momentum
    feed = StepFeed(
        accelerator,
        train_loader,
        train_sampler,
        global_batch_size,
        grad_accum,
        progress,
        task.count_targets,
    )
    feed.seed_dropout(args.seed)  # dropout: each rank its own masks, a resume the same ones
    monitor = RunMonitor(accelerator, args, "train_localsgd", feed, dp_size, global_batch_size)
    bn_line = batchnorm_line(model, dp_size, args.sync_batchnorm)  # what differs from 1 process
    lines = [fusion_line(args, fragments, dp_size, n_params), bn_line]  # Local SGD
    monitor.start(task, model_line, n_params, data, lines, resume_path)

    # ---------------------------------------- the training loop
    step, last_step = progress["step"], min(args.max_steps, args.stop_at_step or args.max_steps)
    model.train()
    while step < last_step and not feed.preempted:
        with monitor.timed_step():  # training time (not the records, evaluations, checkpoints)
            micro_batches, n_global_targets = feed.next_step()
            # Local SGD: forward and backward of each micro-batch; the gradients stay on this rank
            loss_sum = local_forward_backward(accelerator, model, task, micro_batches, n_global_targets, dp_size)
            # Local SGD: this replica's own norm (Accelerate's clipping unscales fp16 gradients)
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm or float("inf"))
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            fused = replica_sync.after_step(step)  # Local SGD: fuse the fragments due at this step

        if monitor.due(step, "train"):
            # Accelerate: the loss sums of all ranks (an all-reduce)
            loss = (accelerator.reduce(loss_sum, reduction="sum") / n_global_targets).item()
            monitor.train(step, loss, lr, grad_norm, **replicas(accelerator, model, fragments, fused))
        if monitor.due(step, "eval") and step < args.max_steps:  # the last one: the fused model
            # Local SGD: between fusions, each rank scores its share of the samples with its replica
            scores = evaluate(accelerator, model, task, data.validation, args.eval_batch_size)
            monitor.eval(step, scores)
        if monitor.due(step, "checkpoint") or feed.preempted:  # Local SGD: each rank its replica
            state = replica_sync.state_dict()  # DiLoCo: θ_last and the outer momentum
            save_checkpoint(accelerator, args, step, feed, model, optimizer, scheduler, facts, True, extra_state=state)
    feed.close()

    # ---------------------------------------- save
    if args.save_rank_models and step == args.max_steps:  # Local SGD: each rank's own replica
        save_rank_model(accelerator, model, task, args.output_dir, data_source(args))
    if step == args.max_steps:  # every rank gathers what it holds; the main process writes
        replica_sync.finish(step)  # Local SGD: the final fusion: one model
        result = evaluate(accelerator, model, task, data.validation, args.eval_batch_size)
        spread = max(replica_spread(accelerator, model, fragments))  # Local SGD: 0, one model
        monitor.eval(step, result, fused_model=True, param_spread=spread)
        export_model(accelerator, model, task, data_source(args), Path(args.output_dir) / "model")
    no_sync.__exit__(None, None, None)  # Local SGD: the end of DDP's no_sync
    steps, record = step - progress["step"], replica_sync.record  # Local SGD: the fusions' figures
    costs = localsgd_summary(accelerator, args, fragments, record, steps, n_params)
    monitor.summary(step, preempted=feed.preempted, **costs)
    del model, optimizer, scheduler, train_loader, feed, replica_sync  # free DDP, the peers live
    accelerator.free_memory()
    accelerator.wait_for_everyone()
    accelerator.end_training()  # Accelerate: closes trackers and destroys the process group


if __name__ == "__main__":
    run_main(main)
