"""Local SGD and DiLoCo in ONE process: the reference a train_localsgd.py run on N processes is held to.

The N replicas live side by side in this process and take turns: replica r trains on the micro-batches
Accelerate would hand rank r (every N-th of the global batch's), with its own inner optimizer (AdamW, SGD
or Muon: make_optimizer's) and scheduler, and every K steps they are fused: averaged, or DiLoCo's outer
Nesterov step on θ_last with the mean Δ = θ_last − θ_r. Written apart from the lesson's ReplicaSync (no
collective, no DDP): what one fusion means, computed once.

    python tests/localsgd_reference.py --replicas 2 --result out.json <train_localsgd.py's flags>

writes {"losses": {step: loss}, "eval_loss": the fused model's} (one fragment, no overlap)."""

import argparse
import copy
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from accelerate.utils import set_seed

from common.builtin_flags import add_builtin_flags
from common.cli import batch_of_step, build_parser
from common.data import load_data
from common.evaluation import evaluate
from common.launch import make_accelerator
from common.loader import make_train_loader
from common.model import context_length, language_model, tokenizer_for
from common.training import make_optimizer, make_scheduler


def parse() -> argparse.Namespace:
    parser = build_parser(__doc__)
    add_builtin_flags(parser)
    g = parser.add_argument_group("Local SGD (train_localsgd.py's, one fragment)")
    g.add_argument("--sync_every", type=int, default=8)
    g.add_argument("--outer_optimizer", choices=["average", "nesterov"], default="average")
    g.add_argument("--outer_lr", type=float, default=0.7)
    g.add_argument("--outer_momentum", type=float, default=0.9)
    g.add_argument("--save_rank_models", action="store_true", help="accepted: it changes nothing computed")
    g.add_argument("--replicas", type=int, required=True, help="the processes of the run it stands for")
    g.add_argument("--result", required=True)
    return parser.parse_args()


def micro_batches(loader, n_replicas: int, grad_accum: int):
    """Each step's micro-batches, per replica: Accelerate hands rank r the micro-batches r, r + N, ..."""
    per_step, epoch = n_replicas * grad_accum, 0
    while True:
        loader.sampler.set_epoch(epoch)
        batches = list(loader)  # whole global batches (the sampler's)
        for i in range(0, len(batches), per_step):
            yield [batches[i : i + per_step][r::n_replicas] for r in range(n_replicas)]
        epoch += 1


@torch.no_grad()
def fuse(replicas: list, last: list | None, outer) -> None:
    """Every replica becomes the fused model: their mean, or θ_last after the outer step on the mean Δ."""
    params = [[p for p in m.parameters() if p.requires_grad] for m in replicas]
    if last is None:
        fused = [torch.stack(ps).sum(0) / len(replicas) for ps in zip(*params, strict=True)]
    else:
        for t, ps in zip(last, zip(*params, strict=True), strict=True):
            t.grad = torch.stack([t - p for p in ps]).sum(0) / len(replicas)
        outer.step()
        fused = last
    for ps in params:
        for p, value in zip(ps, fused, strict=True):
            p.copy_(value)


def main() -> None:
    args = parse()
    n = args.replicas
    accelerator = make_accelerator(args, cpu=True)
    grad_accum, global_batch_size = batch_of_step(args, n)
    data = load_data(args, accelerator, context_length(args), tokenizer_for(args))
    loader = make_train_loader(data.train, args.batch_size, global_batch_size, args.seed)
    set_seed(args.seed)
    model, task = language_model(args, data)
    replicas = [copy.deepcopy(model) for _ in range(n)]
    optimizers = [make_optimizer(m, args) for m in replicas]
    schedulers = [make_scheduler(o, args) for o in optimizers]
    last = outer = None
    if args.outer_optimizer == "nesterov":
        last = [p.detach().clone() for p in model.parameters() if p.requires_grad]
        nesterov = args.outer_momentum > 0
        outer = torch.optim.SGD(last, lr=args.outer_lr, momentum=args.outer_momentum, nesterov=nesterov)
    losses, feed = {}, micro_batches(loader, n, grad_accum)
    for step in range(1, args.max_steps + 1):
        per_replica = next(feed)
        n_global_targets = sum(task.count_targets(mb) for mbs in per_replica for mb in mbs).float()
        loss_sum = 0.0
        for r, (m, optimizer, scheduler) in enumerate(zip(replicas, optimizers, schedulers, strict=True)):
            m.train()
            # dropout: StepFeed's stream of rank r at this step
            torch.manual_seed(int(np.random.SeedSequence([args.seed % 2**64, r, step]).generate_state(1, "u8")[0]))
            for mb in per_replica[r]:
                loss, _ = task.loss_of(m, mb)
                (loss * n / n_global_targets).backward()
                loss_sum += loss.item()
            torch.nn.utils.clip_grad_norm_(m.parameters(), args.max_grad_norm or float("inf"))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        losses[step] = loss_sum / n_global_targets.item()
        if step % args.sync_every == 0 or step == args.max_steps:  # the final fusion: one model
            fuse(replicas, last, outer)
    scores = evaluate(accelerator, replicas[0], task, data.validation, args.eval_batch_size)
    Path(args.result).write_text(json.dumps({"losses": losses, "eval_loss": scores["eval_loss"]}))


if __name__ == "__main__":
    main()
