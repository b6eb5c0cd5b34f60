#!/usr/bin/env python
"""Fully sharded data parallel (FSDP2, ZeRO-3 style) with PyTorch's `fully_shard`, under 🤗 Accelerate.

Like DDP, every rank trains on its own slice of each global batch. Unlike DDP, no rank holds
the whole model: each parameter, its gradient and its optimizer state are cut into N shards,
one per rank. A block's full weights exist only while that block computes:

    for each block, forward:   all-gather the block's shards -> compute -> free the gathered copy
    for each block, backward:  all-gather again -> compute grads -> reduce-scatter them -> free
    optimizer step:            each rank updates only its own shard (Adam state for 1/N of the model)

    memory per rank (fp32 Adam):  DDP 16 bytes x params    FSDP 16/N bytes x params (+ one block unsharded)
    communication per step:       DDP all-reduce 2x        FSDP all-gather x2 + reduce-scatter = 3x (1.5x DDP)

Run it:
    accelerate launch --config_file accelerate_configs/cpu_multi.yaml scripts/train_fsdp.py
    accelerate launch --config_file accelerate_configs/gpu_multi.yaml --mixed_precision bf16 scripts/train_fsdp.py --model_size gpt2
    ... scripts/train_fsdp.py --dp_replicate 2     # HSDP: shard inside groups, replicate across them
Accelerate's own FSDP plugin is not used: on CPU it is silently ignored (CONVENTIONS pitfall 3),
so this file applies FSDP2 itself and refuses a launch that also asks Accelerate for FSDP.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts run as files: make `common` importable

from accelerate.utils import set_seed  # noqa: E402

from common.errors import UsageError  # noqa: E402
from common.launch import build_parser, run_main  # noqa: E402
from common.loop import Run, sharded_step  # noqa: E402
from common.model import GPT  # noqa: E402
from common.parallel import apply_activation_checkpointing, apply_fsdp  # noqa: E402


def check_fsdp_flags(run: Run, args) -> None:
    if args.cpu_offload and run.accelerator.device.type == "cpu":
        raise UsageError("--cpu_offload moves shards, gradients and optimizer state from the accelerator to CPU memory, but this run is already on the CPU: drop --cpu_offload (or run on GPUs)")


def main():
    parser = build_parser(__doc__)
    g = parser.add_argument_group("fully sharded data parallel")
    g.add_argument("--dp_replicate", type=int, default=1, help="HSDP: replicate over this many groups, shard inside each (1: plain FSDP over all processes)")
    g.add_argument("--reshard_after_forward", action=argparse.BooleanOptionalAction, default=True,
                   help="free gathered weights after forward and gather again in backward (ZeRO-3); --no-reshard_after_forward keeps them until backward (ZeRO-2 like: more memory, one all-gather less)")
    g.add_argument("--cpu_offload", action="store_true", help="keep shards, gradients and optimizer state in CPU memory (GPU runs)")
    g.add_argument("--activation_checkpointing", action="store_true", help="recompute each block's activations in backward instead of storing them")
    args = parser.parse_args()
    args.output_dir = args.output_dir or "runs/fsdp"
    # Accelerator, layout (all processes shard the data), data; every check before anything is written
    run = Run(args, "train_fsdp", dp_replicate=args.dp_replicate, dp_shard=-1, check=lambda run: check_fsdp_flags(run, args))
    layout = run.layout

    set_seed(args.seed)  # Accelerate: the same full model on every rank, then sharded: init independent of the layout
    model = GPT(run.model_config).to(run.accelerator.device)

    # ---------------------------------------------------------------- the fully-sharded strategy
    if args.activation_checkpointing:
        apply_activation_checkpointing(model)
    # one FSDP unit per block, then the root (embeddings, final norm, head); a 2-D mesh means HSDP
    apply_fsdp(model, [model], layout.fsdp_mesh, run.accelerator.mixed_precision,
               reshard_after_forward=args.reshard_after_forward, cpu_offload=args.cpu_offload)
    forward_backward, predict = sharded_step(run.accelerator, model, layout)
    # ----------------------------------------------------------------------------------------------

    kind = f"HSDP: {layout.dp_replicate} replicas x {layout.dp_shard} shards" if layout.dp_replicate > 1 else f"FSDP over {layout.dp_shard} ranks"
    run.train(model, forward_backward, predict, strategy_lines=[
        f"{kind}; reshard after forward {'on (ZeRO-3)' if args.reshard_after_forward else 'off (ZeRO-2 like)'}, "
        f"activation checkpointing {'on' if args.activation_checkpointing else 'off'}, cpu offload {'on' if args.cpu_offload else 'off'}",
        f"ZeRO-3 ideal per rank: DDP's state / {layout.dp_shard} (measured exactly after the first step: state_bytes_per_rank_max in the summary)",
    ])


if __name__ == "__main__":
    run_main(main)
