#!/usr/bin/env python
"""Tensor parallelism (Megatron-style) with PyTorch DTensor, under 🤗 Accelerate.

Every weight matrix of a block is cut across the ranks of a TP group; all of them see the same
batch and together compute one layer. Column-parallel layers split their outputs (attention
heads, MLP columns), row-parallel ones their inputs, so each pair needs one all-reduce:

    one block, tp = 2 (x: activations, replicated on both ranks)
                   rank 0                            rank 1
    f ->  q,k,v[:, heads 0..h/2)   attention    q,k,v[:, heads h/2..h)   attention     column-wise
          o_proj[heads 0..h/2 , :]  -> partial  o_proj[heads h/2..h, :]  -> partial    row-wise
    g ->                 all-reduce(partial + partial) = attention output
    f ->  up_proj[:, cols 0..2d)       GELU     up_proj[:, cols 2d..4d)      GELU      column-wise
          down_proj[cols 0..2d, :] -> partial   down_proj[cols 2d..4d, :] -> partial   row-wise
    g ->                 all-reduce = MLP output

    f: identity forward, all-reduce of the input gradient backward;  g: all-reduce forward, identity backward.
    Embedding: vocab rows split (each rank looks up the tokens it holds, partial sums all-reduced).
    LM head: vocab columns split; --loss_parallel computes the cross-entropy on the shards.
    --sequence_parallel: LayerNorms and dropout work on a slice of the sequence; each all-reduce
    becomes an all-gather (before attention/MLP) plus a reduce-scatter (after them).

Run it:
    accelerate launch --config_file accelerate_configs/cpu_multi.yaml scripts/train_tp.py --tp_size 2
    accelerate launch --config_file accelerate_configs/gpu_multi.yaml scripts/train_tp.py --tp_size 8 --sequence_parallel --loss_parallel
With --tp_size smaller than the number of processes, the remaining factor trains data parallel
(FSDP), as in train_hybrid.py.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts run as files: make `common` importable

from accelerate.utils import set_seed  # noqa: E402

from common.launch import build_parser, run_main  # noqa: E402
from common.loop import Run, check_tp_flags, sharded_step  # noqa: E402
from common.model import GPT  # noqa: E402
from common.parallel import apply_fsdp, apply_tensor_parallel  # noqa: E402


def main():
    parser = build_parser(__doc__)
    g = parser.add_argument_group("tensor parallel")
    g.add_argument("--tp_size", type=int, default=-1, help="ranks per TP group (-1: all processes, pure TP)")
    g.add_argument("--sequence_parallel", action="store_true", help="shard LayerNorm/dropout activations along the sequence (all-gather + reduce-scatter instead of all-reduce)")
    g.add_argument("--loss_parallel", action="store_true", help="compute the cross-entropy on vocabulary-sharded logits, never gathering them")
    args = parser.parse_args()
    args.output_dir = args.output_dir or "runs/tp"
    # Accelerator, layout (tp x the rest as data parallel), data; every check before anything is written
    run = Run(args, "train_tp", tp=args.tp_size, dp_shard=1 if args.tp_size == -1 else -1,
              check=lambda run: check_tp_flags(run, args.sequence_parallel, args.loss_parallel))
    layout = run.layout

    set_seed(args.seed)  # Accelerate: the same full model on every rank, then sharded: init independent of the layout
    model = GPT(run.model_config).to(run.accelerator.device)

    # ---------------------------------------------------------------- the tensor-parallel strategy
    # parallelize_module swaps each weight for a DTensor shard and adds the f/g collectives as hooks
    apply_tensor_parallel(model, layout.sub("tp"), sequence_parallel=args.sequence_parallel, loss_parallel=args.loss_parallel)
    if layout.dp > 1:  # processes beyond the TP group: data parallel over the TP groups (FSDP)
        apply_fsdp(model, [model], layout.fsdp_mesh, run.accelerator.mixed_precision)
    forward_backward, predict = sharded_step(run.accelerator, model, layout, loss_parallel=args.loss_parallel)
    # ----------------------------------------------------------------------------------------------

    cfg, tp = run.model_config, layout.tp
    b, s, d = args.batch_size, run.data.seq_len, cfg.n_embd
    megatron_mib = 4 * b * s * d / 2**20  # one all-reduce of the activations, fp32
    run.train(model, forward_backward, predict, strategy_lines=[
        f"tensor parallel: {tp} ranks per group, {cfg.n_head // tp} of {cfg.n_head} heads and {4 * d // tp} of {4 * d} MLP columns each; "
        f"sequence parallel {'on' if args.sequence_parallel else 'off'}, loss parallel {'on' if args.loss_parallel else 'off'}",
        f"Megatron's count per step: per layer 2 all-reduces forward + 2 backward of b*s*d = {megatron_mib:.3f} MiB "
        f"({4 * cfg.n_layer} for {cfg.n_layer} layers{', each as an all-gather + reduce-scatter' if args.sequence_parallel else ''}); "
        "measured counts are in the summary (collectives_first_step_rank0)",
    ], extra_summary=lambda: {"megatron_allreduce_mib_each": round(megatron_mib, 4), "megatron_allreduces_per_step": 4 * cfg.n_layer * args.gradient_accumulation_steps})


if __name__ == "__main__":
    run_main(main)
