"""The command line every training script shares: the core flags (run, batch and optimizer, logging,
evaluation, checkpoints) and their checks, which need nothing but flags. The built-in data sets' and
models' flags are common/builtin_flags.py's: a script adds them, a copy for a model of your own need not."""

from __future__ import annotations

import argparse
import os

from .errors import UsageError

# which data a model learned (saved as model/data.json): the built-in data flags that say it
SOURCE_KEYS = ("dataset", "addition_digits", "dataset_name", "dataset_config", "text_column", "train_file")
SOURCE_KEYS += ("validation_file", "document_mask")


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring's pictures as they are; each real default once (not None, nor a switch's False)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser(description: str) -> argparse.ArgumentParser:
    """The core flags every training script shares; scripts add their own (and the built-in models' and
    data's: common/builtin_flags.py)."""
    p = argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)
    a = p.add_argument_group("run").add_argument
    a("--output_dir", help="everything the run writes goes here (default: runs/<strategy>)")
    a("--overwrite_output_dir", action="store_true", help="start a new run in an --output_dir that holds one")
    a("--max_steps", type=int, default=1500, help="optimizer steps to run")
    a("--stop_at_step", type=int, help="end at step N with a checkpoint, the schedule aiming at --max_steps")
    a("--seed", type=int, default=0, help="fixes init, data order and dropout")
    a("--cpu", action="store_true", help="run on CPU even where CUDA exists")
    a("--collective_timeout", type=float, default=300, help="seconds a collective waits for a peer, then fails")
    a = p.add_argument_group("batch and optimizer").add_argument
    a("--batch_size", type=int, default=64, help="micro-batch per data-parallel rank")
    a("--gradient_accumulation_steps", type=int, default=1, help="micro-batches per optimizer step")
    a("--global_batch_size", type=int, help="keep the global batch whatever the processes: it sets the accumulation")
    muon = "muon (Muon for the hidden matrices, AdamW for the rest: docs/optimizers.md)"
    a("--optimizer", default="adamw", help=f"adamw | sgd (plain SGD, no momentum) | {muon}")
    a("--muon_momentum", type=float, default=0.95, help="--optimizer muon: Nesterov momentum of the matrices")
    a("--ns_steps", type=int, default=5, help="--optimizer muon: Newton–Schulz steps that orthogonalise an update")
    a("--learning_rate", type=float, default=1e-3, help="peak learning rate")
    a("--weight_decay", type=float, default=0.1, help="decoupled weight decay on matrices (not biases, norms)")
    a("--warmup_steps", type=int, default=100, help="linear warm-up, then cosine decay to 10%% of the peak")
    a("--max_grad_norm", type=float, default=1.0, help="clip the global gradient norm (0: no clipping)")
    a("--compile", action="store_true", help="torch.compile each block: faster steps after a first slow one")
    skip = "skip the start-up proof that the cut model computes the uncut one (a probe step, both ways): said"
    a("--skip_cut_check", action="store_true", help=skip + " in the start lines; only for a run known to differ")
    a = p.add_argument_group("logging, evaluation, checkpoints").add_argument
    a("--log_every", type=int, default=10, help="write a train record every N steps")
    a("--eval_every", type=int, default=250, help="evaluate every N steps (0: only at the end)")
    a("--eval_batch_size", type=int, default=250, help="evaluation batch per process")
    a("--checkpoint_every", type=int, default=0, help="save a resumable checkpoint every N steps (0: the model only)")
    a("--keep_last", type=int, default=2, help="keep the newest N checkpoints (0: keep all)")
    a("--resume_from_checkpoint", help="latest | auto (latest if any, else step 0: restarts) | a checkpoint folder")
    a("--report_to", default="none", help="Accelerate trackers: none | tensorboard | wandb | all ...")
    a("--peak_flops", type=float, help="the device's peak FLOP/s, for MFU (default: known GPUs only)")
    a = p.add_argument_group("LoRA adapters (docs/lora.md)").add_argument  # common/lora.py, only when asked
    a("--lora_r", type=int, help="train LoRA adapters of this rank beside the frozen model (default: every weight)")
    a("--lora_alpha", type=float, default=16.0, help="--lora_r: the adapters' update is scaled by alpha / r")
    a("--lora_dropout", type=float, default=0.0, help="--lora_r: dropout on the adapters' input")
    targets = "comma-separated names of the linear layers to adapt (default: the attention and MLP projections)"
    a("--lora_target_modules", help=f"--lora_r: {targets}")
    merge = "--lora_r: also write the merged model (base + B·A) to OUTPUT_DIR/model"
    a("--merge_lora", action="store_true", help=merge)
    return p


def check_core_args(args) -> None:
    """Checks that need nothing but the flags: they run before any process group exists."""
    positive = ("max_steps", "batch_size", "gradient_accumulation_steps", "log_every", "eval_batch_size")
    for flag in positive:
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag} must be at least 1 (got {getattr(args, flag)})")
    for flag in ("eval_every", "checkpoint_every", "keep_last", "warmup_steps", "max_grad_norm", "weight_decay"):
        if getattr(args, flag) < 0:
            raise UsageError(f"--{flag} must not be negative (got {getattr(args, flag)})")
    if args.stop_at_step is not None and not 1 <= args.stop_at_step <= args.max_steps:
        raise UsageError(f"--stop_at_step must be between 1 and --max_steps {args.max_steps} (got {args.stop_at_step})")
    if args.learning_rate <= 0:
        raise UsageError(f"--learning_rate must be positive (got {args.learning_rate})")
    if args.collective_timeout <= 0:
        raise UsageError(f"--collective_timeout must be positive seconds (got {args.collective_timeout})")
    if args.optimizer not in ("adamw", "sgd", "muon"):
        raise UsageError(f"--optimizer {args.optimizer!r} is not supported: use adamw, sgd or muon")
    if args.ns_steps < 1 or not 0 <= args.muon_momentum < 1:
        raise UsageError(
            f"--ns_steps must be at least 1 (got {args.ns_steps}) and --muon_momentum in [0, 1) "
            f"(got {args.muon_momentum})"
        )
    if args.lora_r is not None or args.lora_target_modules or args.merge_lora:
        from .lora import check_lora_args  # only a run that names LoRA

        check_lora_args(args)
    if args.output_dir and os.path.exists(args.output_dir) and not os.path.isdir(args.output_dir):
        raise UsageError(f"--output_dir {args.output_dir} is a file, not a folder: give a folder for the run's outputs")
    if hasattr(args, "model_size"):  # the script added the built-in models' and data's flags
        from .builtin_flags import check_builtin_flags

        check_builtin_flags(args)


def batch_of_step(args, dp_size: int) -> tuple[int, int]:
    """(micro-batches per step, global batch) on dp_size ranks: --global_batch_size sets the accumulation."""
    per_pass, wanted = args.batch_size * dp_size, args.global_batch_size  # per_pass: one micro-batch on each rank
    if wanted is not None and (wanted < 1 or wanted % per_pass or args.gradient_accumulation_steps != 1):
        raise UsageError(
            f"--global_batch_size {wanted} must be a multiple of --batch_size {args.batch_size} x {dp_size} data-"
            f"parallel ranks = {per_pass}, and sets the accumulation itself (no --gradient_accumulation_steps)"
        )
    args.gradient_accumulation_steps = wanted // per_pass if wanted else args.gradient_accumulation_steps
    return args.gradient_accumulation_steps, per_pass * args.gradient_accumulation_steps


def data_source(args) -> dict:
    """What the data is, as saved beside the model so that evaluate.py reads the same split (the built-in
    data flags; nothing for data of your own)."""
    return {k: getattr(args, k) for k in SOURCE_KEYS if hasattr(args, k)}
