"""train_localsgd.py's refusals, one line each, before anything runs: the fusion flags
(check_localsgd_flags), a launch or an Accelerator that shards the model (check_whole_replicas), more
fragments than blocks (check_fragments_fit)."""

from __future__ import annotations

from accelerate import DistributedType

from .errors import UsageError
from .sharded import launcher_sharding


def check_localsgd_flags(args) -> None:
    """The fusion flags and the launch, before anything runs: each mistake is one line that names
    the flag (or the launch's config)."""
    if args.sync_every < 1:
        raise UsageError(
            f"--sync_every must be at least 1 (got {args.sync_every}): the number of local steps between two fusions"
        )
    if args.fragments < 1 or args.sync_every % args.fragments:
        raise UsageError(
            f"--fragments {args.fragments} must divide --sync_every {args.sync_every}: fragment f "
            "is fused at the steps = f*K/F (mod K); pick F among the divisors of K"
        )
    period = args.sync_every // args.fragments  # the steps between two fusions
    if args.outer_optimizer == "nesterov" and (args.outer_lr <= 0 or not 0 <= args.outer_momentum < 1):
        raise UsageError(
            f"--outer_lr {args.outer_lr} / --outer_momentum {args.outer_momentum}: the outer "
            "learning rate must be above 0 and the momentum in [0, 1) (DiLoCo uses 0.7 and 0.9)"
        )
    if args.overlap_steps and (args.outer_optimizer != "nesterov" or not 0 < args.overlap_steps <= period):
        raise UsageError(
            f"--overlap_steps {args.overlap_steps} must be between 1 and --sync_every / "
            f"--fragments = {period}, with --outer_optimizer nesterov: one fusion in flight at a "
            "time, landing before the next starts"
        )
    if not 0 <= args.overlap_mix < 1:
        raise UsageError(
            f"--overlap_mix {args.overlap_mix} must be in [0, 1): the share of its own parameters "
            "a replica keeps when an overlapped fusion lands (0: the fused model alone; Streaming "
            "DiLoCo uses 0.5)"
        )
    if args.outer_dtype == "bf16" and args.outer_optimizer == "average":
        raise UsageError(
            "--outer_dtype bf16 needs --outer_optimizer nesterov: average sends the parameters "
            "themselves, and bf16 would round them to 3 digits; DiLoCo sends the small "
            "pseudo-gradient"
        )
    check_whole_replicas()  # the launcher's flags, before the Accelerator exists


def check_whole_replicas(distributed_type: DistributedType | None = None) -> None:
    """Local SGD averages whole replicas: a sharded strategy (an FSDP or DeepSpeed launch) has none.
    Called before the Accelerator exists, for the launcher's flags (on CPU Accelerate would silently
    drop an FSDP config), and after, with the Accelerator's distributed type."""
    sharded = launcher_sharding()
    if sharded:
        raise UsageError(
            f"Local SGD averages whole replicas and cannot run under {sharded} (a sharded "
            "strategy): launch without an FSDP/DeepSpeed config, e.g. --config_file "
            "accelerate_configs/cpu_multi.yaml"
        )
    if distributed_type not in (None, DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
        raise UsageError(
            f"Local SGD averages whole replicas: it cannot run under {distributed_type}; launch "
            "without an FSDP/DeepSpeed config"
        )


def check_fragments_fit(n_fragments: int, units: list) -> None:
    """Streaming DiLoCo's fragments are runs of blocks: at most one fragment per block."""
    if n_fragments > max(1, len(units)):
        raise UsageError(
            f"--fragments {n_fragments}: the model has {len(units)} blocks, and a fragment holds "
            f"at least one; use --fragments {max(1, len(units))} or fewer"
        )
