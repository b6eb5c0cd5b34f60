#!/usr/bin/env python
"""Expert parallelism (EP) for a mixture-of-experts model, with PyTorch's all-to-all, under 🤗 Accelerate.

In a mixture of experts each block's MLP is E experts, and a router sends every token to k of them.
EP cuts the experts over `ep` ranks; every rank still trains on its own slice of the global batch,
so each MoE layer sends every token to the rank that holds its expert, and the result back:

    ep = 2, E = 4 experts (rank 0 holds experts 0,1; rank 1 holds 2,3), top_k = 1
       rank 0 tokens: a->e0 b->e3 c->e1           rank 1 tokens: d->e2 e->e0 f->e3
    1. all-to-all of the counts: rank 0 learns it gets 2 tokens from itself and 1 from rank 1 ...
    2. all-to-all of the tokens (uneven splits):  rank 0 holds a c e      rank 1 holds b d f
    3. local experts compute:                     e0(a) e1(c) e0(e)      e3(b) e2(d) e3(f)
    4. reverse all-to-all (combine):              each output goes home, weighted there by its gate

    parameters that are not experts: FSDP-sharded over all data-parallel ranks (as train_fsdp.py)
    experts: cut over the ep ranks of a group (dim 0: which experts); with ep < processes, the dp / ep
             groups would hold copies, so FSDP cuts each rank's experts again over them (dim 1)
    memory per rank: experts E / dp of them, E / ep gathered while a MoE layer computes
    all-to-all per MoE layer: tokens x top_k x d x 2 (+ backward)

Run it:
    accelerate launch --config_file accelerate_configs/cpu_multi.yaml scripts/train_ep.py          # ep 2
    accelerate launch --config_file accelerate_configs/cpu_multi.yaml --num_processes 4 scripts/train_ep.py \\
        --ep_size 2                                      # 2 groups of 2: experts cut in 2, each half cut in 2
    accelerate launch --config_file accelerate_configs/gpu_multi.yaml --mixed_precision bf16 scripts/train_ep.py
    python scripts/train_ep.py                           # one process: every expert local, nothing sent
    accelerate launch --config_file accelerate_configs/cpu_multi.yaml scripts/train_ep.py \
        --model_config mixtral                           # a 🤗 MoE family (small defaults): its own experts
Lines marked `# EP:` are the strategy; `# FSDP:` the sharding of the rest; `# Accelerate:` the library's part.
The experts and their router are the built-in GPT's (common/moe.py, flags --n_experts, --top_k ...), or a
🤗 MoE family's (Mixtral, Qwen3-MoE, DeepSeek-V3, gpt-oss ...: the experts its config's base_model_ep_plan
names): its router chooses, our all-to-all carries the (token, expert) pairs, its experts forward computes
on this rank's slice of the batched weights, and the outputs are weighted by its gates at home (docs/ep.md).
"""

import sys
from contextlib import contextmanager
from fnmatch import fnmatch
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts run as files: copy common/ beside this file

import torch
import torch.distributed as dist
from accelerate.utils import get_int_from_env, set_seed
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

from common.checkpoint import check_resume_and_output, export_model, load_checkpoint, save_checkpoint
from common.cli import batch_of_step, build_parser, check_core_args, data_source
from common.costs import count_parameters
from common.cut_check import check_cut, uncut_copy
from common.errors import UsageError
from common.evaluation import evaluate
from common.launch import WORLD_SIZE_VARS, make_accelerator, run_main
from common.layout import Layout
from common.loader import make_train_loader
from common.metrics import RunMonitor
from common.moe import GroupedExperts, dropped_share, expert_load, local, moe_layers, update_expert_bias
from common.sharded import clip_grad_norm_, shard_loader
from common.sharded_costs import local_bytes, sharded_start_line, sharded_summary
from common.task import check_task_contract
from common.training import StepFeed, make_optimizer, make_scheduler

# ======================================== EP: the experts of the MODEL (the built-in GPT's, or a 🤗 family's)
BUILT_IN_EXPERTS = 8  # --n_experts when a run names no model: the built-in GPT with 8 experts per MoE layer
# the built-in GPT's MoE flags: a 🤗 model brings its own router and experts, so they would be ignored
GPT_MOE_FLAGS = ("top_k", "moe_every", "expert_hidden", "shared_expert", "router_score", "load_balance")
GPT_MOE_FLAGS += ("aux_loss_coef", "bias_update_rate", "capacity_factor", "dump_routing")


def check_moe_flags(args, parser) -> bool:
    """--n_experts defaults to BUILT_IN_EXPERTS for the built-in GPT, and is refused with a 🤗 model (its
    config names its experts), as are the GPT's other MoE flags. Returns whether a 🤗 model is trained."""
    hf_model = bool(getattr(args, "model_name_or_path", None) or getattr(args, "model_config", None))
    if not hf_model:
        args.n_experts = BUILT_IN_EXPERTS if args.n_experts is None else args.n_experts
        return False
    given = [f for f in GPT_MOE_FLAGS if getattr(args, f) != parser.get_default(f)]
    given = ["n_experts"] * (args.n_experts is not None) + given
    if given:
        raise UsageError(
            f"--{given[0]} shapes the built-in GPT's experts, but a 🤗 model (--model_name_or_path, --model_config) "
            "brings its own router and experts (its config: num_experts_per_tok, ...): drop --" + given[0]
        )
    args.n_experts = 0  # the built-in GPT's: none (common/builtin_flags.py refuses experts for a 🤗 model)
    return True


def experts_of(model, task) -> list:
    """The batched experts modules EP cuts: the built-in GPT's MoE layers' (GroupedExperts), or those the
    🤗 family's config names for expert parallelism (base_model_ep_plan: 'layers.*.mlp.experts':
    'ep_dispatch_experts'), each holding gate_up_proj (E, ...) and down_proj (E, ...), biases for gpt-oss."""
    if getattr(task, "hf_config", None) is None:
        return [moe.experts for moe in moe_layers(model)]
    plan = getattr(model.config, "base_model_ep_plan", None) or {}
    patterns = [name for name, style in plan.items() if style == "ep_dispatch_experts"]
    return [m for name, m in model.base_model.named_modules() if any(fnmatch(name, p) for p in patterns)]


def check_hf_experts(model, task, expert_modules: list, ep: int) -> None:
    """What EP needs of a 🤗 model, one line each, before training: experts to cut (a dense family has
    none), a count ep divides, and routing that a data-parallel split does not change."""
    c = task.hf_config
    if not expert_modules:
        raise UsageError(
            f"train_ep.py cuts the experts of MoE layers, and {c.model_type} has none (its config names no "
            "ep_dispatch_experts in base_model_ep_plan): train this dense model with train_fsdp.py"
        )
    n_experts = {p.shape[0] for experts in expert_modules for p in experts.parameters()}
    if len(n_experts) != 1 or next(iter(n_experts)) % ep:
        raise UsageError(
            f"--ep_size {ep}: {c.model_type}'s MoE layers hold {sorted(n_experts)} experts, which {ep} ranks cannot "
            "hold equal shares of; use an --ep_size that divides the expert count"
        )
    if getattr(c, "router_jitter_noise", 0):
        raise UsageError(
            f"{c.model_type}'s router_jitter_noise {c.router_jitter_noise} scales every token by random noise, "
            "which differs with the layout; set router_jitter_noise 0 in the config"
        )


# ======================================== EP: the strategy
def apply_expert_parallel(expert_modules: list, ep_mesh) -> None:
    """Each experts module (batched weights of shape (E, ...)) is cut over the ep ranks, and its call wrapped.
    The built-in GPT's (called with tokens sorted by expert and the tokens per expert): dispatch before it,
    combine after it (torchtitan's way: `distribute_module` with input and output functions). A 🤗 family's
    (called with every token and its top-k experts and weights): hf_experts_forward in its place."""
    for experts in expert_modules:
        if isinstance(experts, GroupedExperts):
            distribute_module(experts, ep_mesh, partition_fn=shard_experts, input_fn=dispatch, output_fn=combine)
            continue
        family_forward = experts.forward  # the family's own expert math (its activation, biases, kernels)
        distribute_module(experts, ep_mesh, partition_fn=shard_experts)
        experts.num_experts //= ep_mesh.size()  # EP: the family's forward loops over the experts this rank holds
        experts.forward = partial(hf_experts_forward, experts, family_forward, ep_mesh)


def shard_experts(name, module, ep_mesh) -> None:
    """EP: rank r of the ep group keeps experts [r·E/ep, (r+1)·E/ep): a DTensor Shard(0), so every
    checkpoint holds the full (E, ...) tensors under their full names and can resume on any ep."""
    for param_name, param in list(module.named_parameters(recurse=False)):
        sharded = torch.nn.Parameter(distribute_tensor(param.data, ep_mesh, [Shard(0)]))  # EP: cut the experts
        module.register_parameter(param_name, sharded)


def dispatch(experts, inputs, ep_mesh):
    """Before the local experts: send every token copy to the rank that holds its expert."""
    tokens, tokens_per_expert = inputs  # sorted by expert (all E of them), this rank's tokens
    ep, group = ep_mesh.size(), ep_mesh.get_group()
    # EP: 1. all-to-all of the counts: from each rank, how many tokens for each of my E/ep experts
    received_per_expert = torch.empty_like(tokens_per_expert)
    dist.all_to_all_single(received_per_expert, tokens_per_expert, group=group)
    received_per_expert = received_per_expert.view(ep, -1)  # (source rank, my expert)
    send_splits = tokens_per_expert.view(ep, -1).sum(1).tolist()  # tokens for rank 0, 1, ... (uneven)
    recv_splits = received_per_expert.sum(1).tolist()
    # EP: 2. all-to-all of the tokens, uneven splits; differentiable: backward sends the gradients home
    received = all_to_all_single_autograd(tokens, recv_splits, send_splits, group)
    # they arrive grouped by source rank, then expert: regroup them by expert, for the grouped loop
    n_local = received_per_expert.shape[1]
    expert_of_row = torch.arange(n_local, device=tokens.device).repeat(ep)
    expert_of_row = expert_of_row.repeat_interleave(received_per_expert.flatten())
    order = expert_of_row.argsort(stable=True)
    experts.ep_routes = (order, send_splits, recv_splits)  # what combine undoes
    return received[order], received_per_expert.sum(0)  # EP: 3. the local experts compute on these


def combine(experts, outputs, ep_mesh):
    """After the local experts: every output goes back to the rank its token came from, in the
    order it was sent (the MoE layer then weights it by its gate and adds it to its token)."""
    order, send_splits, recv_splits = experts.ep_routes
    by_source = outputs[order.argsort()]  # back to (source rank, expert) order
    return all_to_all_single_autograd(by_source, send_splits, recv_splits, ep_mesh.get_group())  # EP: 4. combine


def hf_experts_forward(experts, family_forward, ep_mesh, hidden_states, top_k_index, top_k_weights):
    """A 🤗 family's experts under EP, called as its MoE block calls them: every token of this rank (N, d),
    its top-k experts (N, k, global ids) and their weights (N, k), which its router chose (unchanged).

        1-2. each (token, expert) pair to the rank holding that expert: dispatch, as the built-in GPT's
        3.   the family's own forward on this rank's slice of the batched weights: the pairs arrive as top-1
             choices of local experts 0 .. E/ep - 1 with weight 1 (its biases and activation stay its own)
        4.   combine: the outputs back home, weighted there by top_k_weights and summed per token, so the
             router's gradient is computed where its tokens are, as on one process"""
    top_k = top_k_index.shape[-1]
    flat_experts = top_k_index.reshape(-1)
    order = flat_experts.argsort(stable=True)  # the pairs sorted by expert (token order inside)
    pairs_per_expert = torch.bincount(flat_experts, minlength=experts.num_experts * ep_mesh.size())
    received, received_per_expert = dispatch(experts, (hidden_states[order // top_k], pairs_per_expert), ep_mesh)
    local_experts = torch.arange(len(received_per_expert), device=received.device)
    local_ids = local_experts.repeat_interleave(received_per_expert)  # each received pair's local expert
    if len(received) == 0:  # no pair for my experts: one zero row keeps the all-to-all's backward (and FSDP's) running
        received, local_ids = received.sum(0, keepdim=True), local_ids.new_zeros(1)
    unit_weights = torch.ones(len(received), 1, dtype=received.dtype, device=received.device)
    with local_shards(experts):  # EP: the family's forward reads plain tensors, this rank's experts
        expert_out = family_forward(received, local_ids[:, None], unit_weights)[: int(received_per_expert.sum())]
    expert_out = combine(experts, expert_out, ep_mesh)  # EP: 4. back home, in the order the pairs were sent
    weighted = expert_out * top_k_weights.reshape(-1)[order, None].to(expert_out.dtype)
    return torch.zeros_like(hidden_states).index_add_(0, order // top_k, weighted.to(hidden_states.dtype))


@contextmanager
def local_shards(experts):
    """The experts' parameters as this rank's local tensors (Shard(0) of the DTensors) while the family's
    forward runs: it indexes them by expert; gradients flow back into the DTensors."""
    sharded = dict(experts._parameters)
    experts._parameters.update({name: local(param) for name, param in sharded.items()})
    try:
        yield
    finally:
        experts._parameters.update(sharded)


def shard_expert_slices(expert_modules: list, replica_mesh, dp_size: int) -> None:
    """EP: with ep < dp, dp / ep groups of ep ranks would each hold a copy of the same experts.
    FSDP cuts those copies too (torchtitan's way): each rank keeps 1 / (dp / ep) of its experts'
    slice, along dim 1 (dim 0, the experts, is EP's), and gathers it for the layer's forward and
    backward. The gradient of a rank's experts already holds every token of its ep group (the
    all-to-all's backward brought them); FSDP's reduce-scatter adds the dp / ep groups' and
    divides by dp, as for every other parameter (each rank's loss was scaled by dp). (docs/troubleshooting.md,
    "FSDP with a gradient divide factor fails on gloo")"""
    for experts in expert_modules:
        fully_shard(experts, mesh=replica_mesh, shard_placement_fn=lambda param: Shard(1))  # FSDP: cut the slices
        experts.set_gradient_divide_factor(dp_size)  # FSDP: the sum over all dp ranks' tokens, / dp
        if replica_mesh.size() > 1:  # a SUM, then / dp: gloo has no pre-scaled sum (alone, FSDP just divides)
            experts.set_force_sum_reduction_for_comms(True)


def ep_forward_backward(accelerator, model, task, micro_batches: list, n_global_targets, dp_size: int) -> torch.Tensor:
    """Forward and backward of this rank's micro-batches (FSDP reduces every gradient, the experts'
    over the dp / ep groups); returns the loss sum (normalised by the target count of the whole
    global batch, as in train_fsdp.py). Then the MoE's expert bias moves towards balance, from the
    token counts of the whole step (all micro-batches, all ranks), before the optimizer steps. FSDP
    reduce-scatters every micro-batch's gradients, as in train_fsdp.py: a rank holds only its shards."""
    step_loss_sum = torch.zeros((), device=accelerator.device)
    for mb in micro_batches:
        with accelerator.autocast():  # Accelerate: autocast
            loss_sum, _ = task.loss_of(model, mb)  # the MoE layers' all-to-alls run inside
            accelerator.backward(loss_sum * dp_size / n_global_targets)  # Accelerate: backward
        step_loss_sum += loss_sum.detach()
    update_expert_bias(model)  # MoE: one all-reduce of the step's token counts per expert; aux_free moves the bias
    return step_loss_sum


def routing_record(model, ep_size: int, capacity_factor) -> dict:
    """What a train record adds: ep, and per MoE layer the last step's largest token count over
    the mean (1.0: perfectly balanced; counted over the whole global batch), and with
    --capacity_factor the share of token copies dropped."""
    dropped = {"dropped_share": dropped_share(model)} if capacity_factor else {}
    return {"ep": ep_size, "expert_load": expert_load(model), **dropped}


def ep_start_line(n_experts: int, ep_size: int, dp_size: int) -> str:
    """What the run's first lines say of EP: the experts each rank holds, and how FSDP cuts them again."""
    if dp_size == 1:
        return "EP over 1 rank: every expert is local, nothing is sent"
    ep_line = f"EP over {ep_size} ranks: {n_experts // ep_size} of {n_experts} experts per rank"
    return ep_line + (f", each cut again over {dp_size // ep_size} groups (FSDP)" if dp_size > ep_size else "")


def check_expert_slices(expert_modules: list, slices: int) -> None:
    """FSDP cuts each rank's experts along dim 1 (n_embd of up_proj, the hidden width of down_proj)
    into dp / ep equal slices."""
    widths = {p.shape[1] for experts in expert_modules for p in experts.parameters()}
    if any(width % slices for width in widths):
        raise UsageError(
            f"--ep_size: the experts are cut again over the {slices} groups of ep ranks (dp / ep), along their widths "
            f"{sorted(widths)}, which {slices} does not divide; use a larger --ep_size (fewer groups) or widths that "
            f"{slices} divides"
        )


def check_ep_flags(args, world_size: int, hf_model: bool) -> int:
    """EP: the degrees, before any process group exists. Returns ep. (A 🤗 model's experts are counted
    once it is built: check_hf_experts.)"""
    ep = world_size if args.ep_size is None else args.ep_size
    if args.compile:
        raise UsageError(
            "--compile: train_ep.py does not compile its blocks yet (the all-to-all's splits depend on the routing, "
            "which breaks the graph at every MoE layer); drop --compile"
        )
    if args.n_experts < 1 and not hf_model:  # a dense model has no experts to cut: it would train as plain FSDP
        raise UsageError(
            f"--n_experts {args.n_experts}: expert parallelism cuts the experts of MoE layers, and this model has "
            "none; give it experts (--n_experts 8, the default), or train a dense model with train_fsdp.py"
        )
    if ep < 1:
        raise UsageError(f"--ep_size must be at least 1 (got {ep}; leave it out: all {world_size} processes)")
    if world_size % ep:
        raise UsageError(
            f"--ep_size {ep} does not divide the {world_size} data-parallel processes: the experts are cut over groups "
            f"of ep ranks that tile the processes; use an --ep_size that divides {world_size}"
        )
    if not hf_model and args.n_experts % ep:
        raise UsageError(
            f"--n_experts {args.n_experts} is not divisible by --ep_size {ep}: every EP rank holds the same number of "
            f"experts; use a multiple of {ep} experts or another --ep_size"
        )
    return ep


def main():
    # ---------------------------------------- flags
    parser = build_parser(__doc__)
    from common.builtin_flags import add_builtin_flags  # the built-in data sets' and models' flags

    add_builtin_flags(parser, moe=True)  # data and a model of your own: drop these two lines
    parser.set_defaults(n_experts=None)  # EP: the built-in GPT's 8 experts, or a 🤗 model's own (check_moe_flags)
    g = parser.add_argument_group("expert parallel")
    g.add_argument("--ep_size", type=int, help="ranks the experts are cut over (default: all processes)")
    args = parser.parse_args()
    args.output_dir = args.output_dir or "runs/ep"
    hf_model = check_moe_flags(args, parser)  # EP: --n_experts is the built-in GPT's; a 🤗 model has its own
    check_core_args(args)
    ep_size = check_ep_flags(args, get_int_from_env(WORLD_SIZE_VARS, 1), hf_model)  # EP: before any process group

    # ---------------------------------------- Accelerator and layout
    # Accelerate: process group (gloo on CPU, NCCL on GPU), device, mixed precision from the launcher.
    # cpu=True where CUDA is missing: the N processes then join one gloo group (without it, each trains alone).
    # The scheduler counts optimizer steps (step_scheduler_with_optimizer=False), whatever the layout.
    accelerator = make_accelerator(
        args,
        cpu=args.cpu or not torch.cuda.is_available(),
        sharded=True,  # refuses a launch that also asks Accelerate to shard
        step_scheduler_with_optimizer=False,
    )
    # EP: groups of ep consecutive ranks cut the experts between them (the layout's dp_shard);
    # EP: the dp / ep groups cut each rank's share again (the layout's dp_replicate)
    layout = Layout.from_degrees(accelerator.num_processes, dp_replicate=accelerator.num_processes // ep_size)
    dp_size = layout.dp  # EP: every rank is a data-parallel rank, holding E / ep experts (FSDP: 1/dp of the rest)
    grad_accum, global_batch_size = batch_of_step(args, dp_size)  # batch_size x dp_size x accumulation

    # ---------------------------------------- data (checked before anything is written)
    # the built-in data sets (addition, pystdlib, hub, your files), cut to the model's context, in its tokens
    from common.data import load_data
    from common.model import context_length, tokenizer_for

    data = load_data(args, accelerator, context_length(args), tokenizer_for(args))
    train_loader = make_train_loader(data.train, args.batch_size, global_batch_size, args.seed)

    # ---------------------------------------- MODEL: the only lines that name the model (docs/your-model.md)
    set_seed(args.seed)  # Accelerate: the same full model on every rank: init independent of the layout
    # MoE: the built-in GPT with MoE layers (--n_experts ...: the experts EP cuts), or a 🤗 MoE model
    # (--model_config, --model_name_or_path: Mixtral, Qwen3-MoE, DeepSeek-V3, gpt-oss ...), and its Task:
    # the loss of a micro-batch as (loss_sum, n_targets), the targets it counts, its evaluation and export
    from common.model import language_model

    model, task = language_model(args, data)
    model = model.to(accelerator.device)
    units = task.units(model)  # the blocks: one FSDP unit each
    expert_modules = experts_of(model, task)  # EP: what it cuts, each MoE layer's batched experts
    if hf_model:  # EP: a 🤗 family's experts, named by its config's base_model_ep_plan
        check_hf_experts(model, task, expert_modules, ep_size)
    check_expert_slices(expert_modules, dp_size // ep_size)  # EP: FSDP can cut them again over the dp / ep groups
    n_params, model_line = count_parameters(model), task.describe(model)
    resume_path, facts = check_resume_and_output(accelerator, args, model, task, global_batch_size, layout)
    reference = uncut_copy(model, task, args.skip_cut_check)  # the model as built: what the cut must compute
    layout.build_mesh(accelerator.device.type)

    # ---------------------------------------- EP: the strategy, then FSDP for the rest
    if dp_size > 1:  # one process: every expert is local, nothing to send or shard
        apply_expert_parallel(expert_modules, layout.sub("dp_shard"))  # EP: cut experts over the ep ranks
        shard_expert_slices(expert_modules, layout.sub("dp_replicate"), dp_size)  # FSDP: ... and over dp / ep
        for unit in [*units.children(), model]:  # FSDP: every block, then the root (the experts are sharded)
            fully_shard(unit, mesh=layout.sub("dp"), reshard_after_forward=unit is not model)

    # ---------------------------------------- optimizer (after sharding: it sees the shards)
    optimizer = make_optimizer(model, args)
    scheduler = make_scheduler(optimizer, args)
    # Accelerate: optimizer/scheduler wrappers (not the model: FSDP owns it); the loader sharded over the dp ranks
    optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
    train_sampler = train_loader.sampler
    train_loader = shard_loader(train_loader, accelerator, layout)
    check_task_contract(task, model, data.validation, accelerator.device)  # one line per mistake, before step 1
    probe_step = partial(ep_forward_backward, accelerator, model, task, dp_size=dp_size)  # EP: the step, on a probe
    cut_line = check_cut(accelerator, model, probe_step, reference, task, data.validation, grad_accum, layout)
    progress = load_checkpoint(accelerator, resume_path, model, optimizer, scheduler)  # step 0 without a checkpoint
    feed = StepFeed(
        accelerator,
        train_loader,
        train_sampler,
        global_batch_size,
        grad_accum,
        progress,
        task.count_targets,
        dp_group=layout.group("dp"),
    )
    feed.seed_dropout(args.seed, layout)  # dropout: each data-parallel rank its own masks, a resume the same ones
    monitor = RunMonitor(accelerator, args, "train_ep", feed, layout.world_size, global_batch_size)
    ep_line = ep_start_line(expert_modules[0].down_proj.shape[0], ep_size, dp_size)  # EP: the experts per rank
    costs = sharded_start_line(model, layout, n_params, args.optimizer, accelerator)
    monitor.start(task, model_line, n_params, data, [ep_line, costs, cut_line], resume_path, layout)

    # ---------------------------------------- the training loop
    step, last_step = progress["step"], min(args.max_steps, args.stop_at_step or args.max_steps)
    model.train()
    while step < last_step and not feed.preempted:
        with monitor.timed_step():  # training time: the records, evaluations and checkpoints below are not
            micro_batches, n_global_targets = feed.next_step()
            with monitor.collectives():  # EP: per MoE layer, all-to-all out and back (and again in backward)
                loss_sum = ep_forward_backward(accelerator, model, task, micro_batches, n_global_targets, dp_size)
            grad_norm = clip_grad_norm_(model.parameters(), args.max_grad_norm)  # the whole model's norm, every rank
            lr = scheduler.get_last_lr()[0]
            optimizer.step()  # FSDP: each rank updates its own shard
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

        if monitor.due(step, "train"):
            loss = (accelerator.reduce(loss_sum, reduction="sum") / n_global_targets).item()  # Accelerate: all-reduce
            routing = routing_record(model, ep_size, args.capacity_factor)  # MoE: each layer's expert load
            monitor.train(step, loss, lr, grad_norm, **routing)  # EP: the record adds ep and the routing
        if monitor.due(step, "eval"):
            monitor.eval(step, evaluate(accelerator, model, task, data.validation, args.eval_batch_size, layout))
        if monitor.due(step, "checkpoint") or feed.preempted:  # every rank writes its part (a collective)
            save_checkpoint(accelerator, args, step, feed, model, optimizer, scheduler, facts)
    feed.close()

    # ---------------------------------------- save
    if step == args.max_steps:  # every rank (it gathers what the model holds); the main process writes
        export_model(accelerator, model, task, data_source(args), Path(args.output_dir) / "model", layout)
    costs = sharded_summary(accelerator, layout, n_params, args.optimizer, model, optimizer)
    expert_bytes = local_bytes(p for experts in expert_modules for p in experts.parameters())  # EP: this rank's
    costs = {"ep": ep_size, "expert_param_bytes_per_rank": expert_bytes, **costs}  # EP: in the summary
    monitor.summary(step, preempted=feed.preempted, **costs)
    accelerator.wait_for_everyone()
    accelerator.end_training()  # Accelerate: closes trackers and destroys the process group


if __name__ == "__main__":
    run_main(main)
