"""The router's gradient under expert parallelism, against one process (test_hf_ep.py; the bug class of
transformers#45473 / #48687: a correct-looking loss with a wrong router gradient).

    accelerate launch --num_processes N tests/hf_ep_driver.py SPEC.json   (or a case of tests/zoo_driver.py,
    on the process group it keeps)      SPEC.json: {"configs": {family: config.json}, "ep_size": ep, "results": path}

Every rank builds the same model (one seed) and keeps an untouched copy. The copy runs one forward and
backward on the whole global batch, alone (the one-process run). The model is cut as train_ep.py cuts it
(its apply_expert_parallel, shard_expert_slices, then fully_shard of every decoder layer and the root over
the dp ranks) and runs the same step on this rank's slice, its loss sum scaled by dp / the global target
count as in ep_forward_backward. Rank 0 writes, per family, the loss difference and the largest
differences of the router's gradient (weight, and bias where the router has one) and of every gradient."""

import copy
import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import torch
import torch.distributed as dist
import train_ep
from torch.distributed.fsdp import fully_shard

from common.hf import load_hf_model
from common.hf_ep import check_hf_experts
from common.layout import Layout

GLOBAL_BATCH, SEQ_LEN = 16, 16
ROUTER_NAMES = (".mlp.gate.", ".mlp.router.")  # Mixtral, Qwen3-MoE, DeepSeek-V3: gate; gpt-oss: router


def global_batch(seed: int) -> dict:
    """Random byte ids; targets of unequal counts per sample (a prefix masked), as the addition rows have."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 256, (GLOBAL_BATCH, SEQ_LEN), generator=g)
    labels = input_ids.clone()
    masked = torch.randint(1, SEQ_LEN // 2, (GLOBAL_BATCH, 1), generator=g)
    labels[torch.arange(SEQ_LEN)[None, :] < masked] = -100
    return {"input_ids": input_ids, "labels": labels}


def full(grad: torch.Tensor) -> torch.Tensor:
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


def compare(config_path: str, ep: int, layout: Layout) -> dict:
    torch.manual_seed(0)
    args = SimpleNamespace(model_config=config_path, model_name_or_path=None, block_size=None)
    model, task = load_hf_model(args, SEQ_LEN, "addition", tokenizer=None)
    reference = copy.deepcopy(model)
    batch = global_batch(1)
    n_global_targets = task.count_targets(batch)

    loss_sum, _ = task.loss_of(reference, batch)  # the one-process step
    (loss_sum / n_global_targets).backward()
    expected = {name: p.grad for name, p in reference.named_parameters()}

    dp = layout.dp  # the step train_ep.py runs: its cuts, this rank's samples, its loss scale
    expert_modules = train_ep.experts_of(model, task)
    check_hf_experts(model, task, expert_modules, ep)
    train_ep.apply_expert_parallel(expert_modules, layout.sub("dp_shard"))
    train_ep.shard_expert_slices(expert_modules, layout.sub("dp_replicate"), dp)
    for unit in [*task.units(model).children(), model]:
        fully_shard(unit, mesh=layout.sub("dp"), reshard_after_forward=unit is not model)
    mine = slice(layout.dp_rank * GLOBAL_BATCH // dp, (layout.dp_rank + 1) * GLOBAL_BATCH // dp)
    my_loss_sum, _ = task.loss_of(model, {k: v[mine] for k, v in batch.items()})
    (my_loss_sum * dp / n_global_targets).backward()
    dist.all_reduce(my_loss_sum := my_loss_sum.detach())

    diffs, router, router_max = {}, 0.0, 0.0
    for name, p in model.named_parameters():
        got = full(p.grad)
        diffs[name] = float((got - expected[name]).abs().max())
        if any(r in f".{name}" for r in ROUTER_NAMES):
            router, router_max = max(router, diffs[name]), max(router_max, float(expected[name].abs().max()))
    return {
        "loss_diff": abs(float(my_loss_sum - loss_sum.detach()) / float(n_global_targets)),
        "router_grad_diff": router,
        "router_grad_max": router_max,  # the size of what is compared: a wrong gradient differs by about this
        "n_router_params": sum(any(r in f".{n}" for r in ROUTER_NAMES) for n, _ in model.named_parameters()),
        "grad_diff_all": max(diffs.values()),
        "worst_param": max(diffs, key=diffs.get),
    }


def main():
    spec = json.loads(Path(sys.argv[1]).read_text())
    own_group = not dist.is_initialized()  # under tests/zoo_driver.py the group of the launch's first case
    if own_group:
        dist.init_process_group("gloo")
    world, ep = dist.get_world_size(), spec["ep_size"]
    layout = Layout.from_degrees(world, dp_replicate=world // ep)
    layout.build_mesh("cpu")
    results = {family: compare(path, ep, layout) for family, path in spec["configs"].items()}
    if dist.get_rank() == 0:
        Path(spec["results"]).write_text(json.dumps(results, indent=1))
    if own_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
