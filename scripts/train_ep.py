#!/usr/bin/env python
"""Expert parallelism (EP) for a mixture of experts, with PyTorch's all-to-all, under 🤗 Accelerate.

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
    experts: cut over the ep ranks of a group (dim 0: which experts); with ep < processes, the
             dp / ep groups would hold copies, so FSDP cuts each rank's experts again (dim 1)
    memory per rank: experts E / dp of them, E / ep gathered while a MoE layer computes
    all-to-all per MoE layer: tokens x top_k x d x 2 (+ backward)

Run it:
    accelerate launch --config_file accelerate_configs/cpu_multi.yaml scripts/train_ep.py   # ep 2
    accelerate launch --config_file accelerate_configs/cpu_multi.yaml --num_processes 4 \\
        scripts/train_ep.py --ep_size 2          # 2 groups of 2: experts cut in 2, each half in 2
    accelerate launch --config_file accelerate_configs/gpu_multi.yaml --mixed_precision bf16 \\
        scripts/train_ep.py
    python scripts/train_ep.py                   # one process: every expert local, nothing sent
    accelerate launch --config_file accelerate_configs/cpu_multi.yaml scripts/train_ep.py \\
        --model_config mixtral                   # a 🤗 MoE family (small defaults), its own experts
Lines marked `# EP:` are the strategy; `# FSDP:` the sharding of the rest; `# Accelerate:` the
library's part. The experts and their router are the built-in GPT's (common/moe.py: --n_experts,
--top_k ...), or a 🤗 MoE family's (Mixtral, Qwen3-MoE, DeepSeek-V3, gpt-oss ...; common/hf_ep.py):
its router chooses, our all-to-all carries the (token, expert) pairs (docs/ep.md).
"""

import sys
from functools import partial
from pathlib import Path

# scripts run as files: copy common/ beside this file
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
from accelerate.utils import get_int_from_env, set_seed
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

from common.checkpoint import export_model, load_checkpoint, save_checkpoint, start_point
from common.cli import batch_of_step, build_parser, check_core_args, data_source
from common.contract_check import check_task_contract
from common.costs import count_parameters
from common.cut_check import check_cut, uncut_copy
from common.ep_checks import check_ep_flags, check_experts, check_moe_flags
from common.ep_costs import ep_start_line, ep_summary, routing_record
from common.evaluation import evaluate
from common.launch import WORLD_SIZE_VARS, make_accelerator, record_peers, run_main
from common.layout import Layout
from common.loader import make_train_loader
from common.metrics import RunMonitor
from common.moe import GroupedExperts, moe_layers, update_expert_bias
from common.output_checks import check_resume_and_output, trial_checkpoint
from common.sharded import clip_grad_norm_, shard_loader
from common.sharded_costs import sharded_start_line, sharded_summary
from common.training import StepFeed, make_optimizer, make_scheduler


# ======================================== EP: the strategy
def apply_expert_parallel(expert_modules: list, ep_mesh) -> None:
    """Each experts module (batched weights of shape (E, ...)) is cut over the ep ranks, and its
    call wrapped. The built-in GPT's (called with tokens sorted by expert, and the tokens per
    expert): dispatch before it, combine after it (torchtitan's way: `distribute_module` with input
    and output functions). A 🤗 family's (called with every token, its top-k experts and weights):
    its forward runs between dispatch and combine (common/hf_ep.py)."""
    for experts in expert_modules:
        if isinstance(experts, GroupedExperts):  # the built-in GPT's
            distribute_module(  # EP: cut the experts; dispatch before each call, combine after it
                experts, ep_mesh, partition_fn=shard_experts, input_fn=dispatch, output_fn=combine
            )
            continue
        from common.hf_ep import route_hf_experts  # a 🤗 family's: lazy, only its run imports it

        distribute_module(experts, ep_mesh, partition_fn=shard_experts)  # EP: cut, as the GPT's
        route_hf_experts(experts, ep_mesh, dispatch, combine)  # its forward between the two


def shard_experts(name, module, ep_mesh) -> None:
    """EP: rank r of the ep group keeps experts [r·E/ep, (r+1)·E/ep): a DTensor Shard(0), so every
    checkpoint holds the full (E, ...) tensors under their full names and can resume on any ep."""
    for param_name, param in list(module.named_parameters(recurse=False)):
        sharded = torch.nn.Parameter(distribute_tensor(param.data, ep_mesh, [Shard(0)]), param.requires_grad)  # EP: cut
        module.register_parameter(param_name, sharded)


def dispatch(experts, inputs, ep_mesh):
    """Before the local experts: send every token copy to the rank that holds its expert."""
    tokens, tokens_per_expert = inputs  # sorted by expert (all E of them), this rank's tokens
    ep, group = ep_mesh.size(), ep_mesh.get_group()
    # EP: 1. all-to-all of the counts: from each rank, how many tokens for each of my E/ep experts
    received_per_expert = torch.empty_like(tokens_per_expert)
    dist.all_to_all_single(received_per_expert, tokens_per_expert, group=group)
    received_per_expert = received_per_expert.view(ep, -1)  # (source rank, my expert)
    send_splits = tokens_per_expert.view(ep, -1).sum(1).tolist()  # tokens for rank 0, 1, ...
    recv_splits = received_per_expert.sum(1).tolist()
    # EP: 2. all-to-all of the tokens (uneven splits); its backward sends the gradients home
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
    # EP: 4. combine: every output back to the rank of its token
    return all_to_all_single_autograd(by_source, send_splits, recv_splits, ep_mesh.get_group())


def shard_expert_slices(expert_modules: list, replica_mesh, dp_size: int) -> None:
    """EP: with ep < dp, dp / ep groups of ep ranks would each hold a copy of the same experts.
    FSDP cuts those copies too (torchtitan's way): each rank keeps 1 / (dp / ep) of its experts'
    slice, along dim 1 (dim 0, the experts, is EP's), and gathers it for the layer's forward and
    backward. The gradient of a rank's experts already holds every token of its ep group (the
    all-to-all's backward brought them); FSDP's reduce-scatter adds the dp / ep groups' and
    divides by dp, as for every other parameter (each rank's loss was scaled by dp).
    (docs/troubleshooting.md, "FSDP with a gradient divide factor fails on gloo")"""
    for experts in expert_modules:
        fully_shard(experts, mesh=replica_mesh, shard_placement_fn=lambda param: Shard(1))
        experts.set_gradient_divide_factor(dp_size)  # FSDP: the sum over all dp ranks' tokens, / dp
        if replica_mesh.size() > 1:  # a SUM, then / dp: gloo has no pre-scaled sum
            experts.set_force_sum_reduction_for_comms(True)


def ep_forward_backward(accelerator, model, task, micro_batches: list, n_global_targets, dp_size: int) -> torch.Tensor:
    """EP's step: forward and backward of this rank's own micro-batches; inside each MoE layer the
    all-to-alls of dispatch() and combine() carry every token to the rank of its expert and back
    (their backward carries the gradients). FSDP reduce-scatters every micro-batch's gradients (the
    experts' over the dp / ep groups), so a rank keeps its shards; each reduce-scatter averages over
    the dp ranks, so the loss, divided by the target count of the whole global batch, is multiplied
    by dp_size. Then the MoE's expert bias moves towards balance, from the token counts of the whole
    step (all micro-batches, all ranks), before the optimizer steps. Returns the loss sum."""
    step_loss_sum = torch.zeros((), device=accelerator.device)
    for mb in micro_batches:
        with accelerator.autocast():  # Accelerate: autocast
            loss_sum, _ = task.loss_of(model, mb)  # the MoE layers' all-to-alls run inside
            accelerator.backward(loss_sum * dp_size / n_global_targets)  # Accelerate: backward
        step_loss_sum += loss_sum.detach()
    update_expert_bias(model)  # MoE: one all-reduce of the step's counts; aux_free moves the bias
    return step_loss_sum


def experts_of(model, task) -> list:
    """The batched experts modules EP cuts: the built-in GPT's MoE layers' (GroupedExperts), or
    those a 🤗 family's config names for expert parallelism (base_model_ep_plan)."""
    if getattr(task, "hf_config", None) is None:
        return [moe.experts for moe in moe_layers(model)]
    from common.hf_ep import hf_experts_of  # lazy: only a 🤗 model's run imports it

    return hf_experts_of(model)


def main():
    # ---------------------------------------- flags
    parser = build_parser(__doc__)
    from common.builtin_flags import add_builtin_flags  # the built-in data sets' and models' flags

    add_builtin_flags(parser, moe=True)  # data and a model of your own: drop these two lines
    parser.set_defaults(n_experts=None)  # EP: the built-in GPT's 8 experts, or a 🤗 model's own
    g = parser.add_argument_group("expert parallel")
    g.add_argument("--ep_size", type=int, help="ranks the experts are cut over (default: all processes)")
    args = parser.parse_args()
    args.output_dir = args.output_dir or "runs/ep"
    hf_model = check_moe_flags(args, parser)  # EP: a 🤗 model brings its own experts
    check_core_args(args)
    ep_size = check_ep_flags(args, get_int_from_env(WORLD_SIZE_VARS, 1), hf_model)
    # the accumulation follows the processes launched (an elastic run keeps its global batch)
    grad_accum, global_batch_size = batch_of_step(args, get_int_from_env(WORLD_SIZE_VARS, 1))

    # ---------------------------------------- Accelerator and layout
    # Accelerate: process group (gloo on CPU, NCCL on GPU), device, mixed precision (launcher).
    # cpu=True where CUDA is missing: the N processes then join one gloo group (else each
    # trains alone). The scheduler counts optimizer steps, whatever the layout.
    accelerator = make_accelerator(
        args,
        cpu=args.cpu or not torch.cuda.is_available(),
        sharded=True,  # refuses a launch that also asks Accelerate to shard
        step_scheduler_with_optimizer=False,
    )
    record_peers(accelerator)  # guard: peer records
    # EP: groups of ep consecutive ranks cut the experts between them (the layout's dp_shard);
    # the dp / ep groups cut each rank's share again (the layout's dp_replicate)
    dp_size = accelerator.num_processes  # EP: every rank is data-parallel, holding E / ep experts
    layout = Layout.from_degrees(dp_size, dp_replicate=dp_size // ep_size)

    # ---------------------------------------- data (checked before anything is written)
    # the built-in data sets (addition, pystdlib, hub, your files) in the model's context and tokens
    from common.data import load_data
    from common.model import context_length, tokenizer_for

    data = load_data(args, accelerator, context_length(args), tokenizer_for(args))
    train_loader = make_train_loader(data.train, args.batch_size, global_batch_size, args.seed)

    # ---------------------------------------- MODEL: the only lines that name the model
    set_seed(args.seed)  # Accelerate: the same full model on every rank, whatever the layout
    # the built-in MoE GPT or a 🤗 MoE model (--model_name_or_path, --model_config), and its Task:
    # a micro-batch's (loss_sum, n_targets), its evaluation and export (docs/your-model.md)
    from common.model import language_model

    model, task = language_model(args, data)
    model = model.to(accelerator.device)
    expert_modules = experts_of(model, task)  # EP: what it cuts, each MoE layer's batched experts
    check_experts(model, task, expert_modules, ep_size, dp_size)  # EP: one line per mistake
    n_params, model_line = count_parameters(model), task.describe(model)
    resume_path, facts = start_point(accelerator, args, model, task, global_batch_size, layout)
    check_resume_and_output(accelerator, args, resume_path, facts)  # guard: output lock
    reference = uncut_copy(model, task, args.skip_cut_check)  # guard: cut check
    layout.build_mesh(accelerator.device.type)

    # ---------------------------------------- EP: the strategy and FSDP, before the optimizer
    if dp_size > 1:  # one process: every expert is local, nothing to send or shard
        apply_expert_parallel(expert_modules, layout.sub("dp_shard"))  # EP: cut over ep ranks
        shard_expert_slices(expert_modules, layout.sub("dp_replicate"), dp_size)  # FSDP: dp / ep
        for unit in [*task.units(model).children(), model]:  # FSDP: every block, then the root
            fully_shard(unit, mesh=layout.sub("dp"), reshard_after_forward=unit is not model)

    # ---------------------------------------- optimizer
    optimizer = make_optimizer(model, args)
    scheduler = make_scheduler(optimizer, args)
    train_sampler = train_loader.sampler
    # Accelerate: optimizer and scheduler wrappers (not the model: FSDP owns it);
    # the loader sharded over the dp ranks
    optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
    train_loader = shard_loader(train_loader, accelerator, layout)
    check_task_contract(task, model, data.validation, accelerator.device)  # guard: contract
    probe_step = partial(ep_forward_backward, accelerator, model, task, dp_size=dp_size)  # the step
    check_cut(accelerator, model, probe_step, reference, task, data.validation, grad_accum, layout)  # guard: cut check
    progress = load_checkpoint(accelerator, resume_path, model, optimizer, scheduler)  # or step 0
    trial_checkpoint(accelerator, args, facts, model, optimizer, scheduler)  # guard: trial
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
    feed.seed_dropout(args.seed, layout)  # dropout: each dp rank its own masks
    monitor = RunMonitor(accelerator, args, "train_ep", feed, dp_size, global_batch_size)
    ep_line = ep_start_line(expert_modules[0].down_proj.shape[0], ep_size, dp_size)
    routing = partial(routing_record, model, ep_size)  # EP: for the records
    costs = sharded_start_line(model, layout, n_params, args.optimizer, accelerator)
    monitor.start(task, model_line, n_params, data, [ep_line, costs], resume_path, layout)

    # ---------------------------------------- the training loop
    step, last_step = progress["step"], min(args.max_steps, args.stop_at_step or args.max_steps)
    model.train()
    while step < last_step and not feed.preempted:
        with monitor.timed_step():  # training time (not the records, evaluations, checkpoints)
            micro_batches, n_global_targets = feed.next_step()
            with monitor.collectives():  # EP: all-to-alls in every MoE layer
                loss_sum = ep_forward_backward(accelerator, model, task, micro_batches, n_global_targets, dp_size)
            grad_norm = clip_grad_norm_(model.parameters(), args.max_grad_norm)
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

        if monitor.due(step, "train"):
            # Accelerate: the loss sums of all ranks (an all-reduce)
            loss = (accelerator.reduce(loss_sum, reduction="sum") / n_global_targets).item()
            monitor.train(step, loss, lr, grad_norm, **routing())  # EP: the record adds the routing
        if monitor.due(step, "eval"):
            scores = evaluate(accelerator, model, task, data.validation, args.eval_batch_size, layout)
            monitor.eval(step, scores)
        if monitor.due(step, "checkpoint") or feed.preempted:  # every rank writes its part
            save_checkpoint(accelerator, args, step, feed, model, optimizer, scheduler, facts)
    feed.close()

    # ---------------------------------------- save
    if step == args.max_steps:  # every rank gathers what it holds; the main process writes
        export_model(accelerator, model, task, data_source(args), Path(args.output_dir) / "model", layout)
    costs = sharded_summary(accelerator, layout, n_params, args.optimizer, model, optimizer)
    costs = {**ep_summary(expert_modules, ep_size), **costs}  # EP: the experts' bytes on this rank
    monitor.summary(step, preempted=feed.preempted, **costs)
    accelerator.wait_for_everyone()
    accelerator.end_training()  # Accelerate: closes trackers and destroys the process group


if __name__ == "__main__":
    run_main(main)
