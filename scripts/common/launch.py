"""Launch helpers: the command line every script shares, the Accelerator set-up with CPU
detection and the launch-trap checks, seeding, and one-line errors for bad input."""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import signal
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch

from .data import add_data_args, check_data_args
from .errors import NothingToDo, RunPosition, UsageError
from .layout import release_process_groups
from .model import MODEL_PRESETS, gpt_config_from_args


def run_main(main) -> None:
    """Run `main()`; turn a UsageError into one line on stderr (from rank 0) and exit 2.

    The other ranks wait a little first (wait_for_rank0_to_report), so the line is not lost.

    Every way out ends the process groups first (end_process_groups): none may be left for the
    interpreter's shutdown to free (docs/fault-tolerance.md, "Clean exits").

    A collective that fails because a peer froze or died ends the run with one line naming the
    step and the collective (lost_peer_line), exit code 1."""
    try:
        main()
    except UsageError as e:
        if int(os.environ.get("RANK", "0")) != 0 and world_size_from_env() > 1:
            wait_for_rank0_to_report()
        print(f"error: {e}", file=sys.stderr, flush=True)
        report_to_launcher(f"error: {e}")
        end_process_groups()
        sys.exit(2)
    except NothingToDo as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(str(e), flush=True)
        end_process_groups()
        sys.exit(0)
    except BaseException as e:  # CheckpointException (a peer lost during a save) is a BaseException
        line = lost_peer_line(e)
        if line is None:
            raise
        # every rank that saw it says so (the one that froze or died may be rank 0)
        print(line, file=sys.stderr, flush=True)
        report_to_launcher(line)
        sys.stdout.flush()
        os._exit(1)  # tearing the process group down could wait for the lost peer
    end_process_groups()


def end_process_groups() -> None:
    """Destroy the process group where the run has not (the one-process group of a sharded
    script, an early error), then free the groups the meshes still hold. Left to the
    interpreter's shutdown, gloo's C++ teardown aborted about one finished run in 25 on a loaded
    machine (release_process_groups)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    release_process_groups()
    # Nothing is garbage after release_process_groups' collection: move every object to the
    # permanent generation, so the interpreter's shutdown does not walk the ~3M objects that
    # torch's modules create once more (about 1 s per process).
    gc.freeze()


# How long a rank other than 0 waits, after a bad-input error, for rank 0 to report it.
USAGE_ERROR_GRACE_S = 20.0


def wait_for_rank0_to_report() -> None:
    """Most bad input fails the same check on every rank, and rank 0 says so once. A rank that
    exited first would make the launcher stop rank 0 before it printed its line, so the others
    wait: when rank 0 exits the launcher ends them (default SIGTERM, not the preemption
    handler). A rank still alive after the grace period saw an error of its own and prints it."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    time.sleep(USAGE_ERROR_GRACE_S)


# What gloo says when a peer stops answering (--collective_timeout passed) or goes away.
TIMEOUT_SIGNS = ("timed out", "timeout caused pair closure", "timeout waiting", "socket timeout")
GONE_SIGNS = ("connection closed by peer", "connection reset by peer", "broken pipe", "read error", "socket closed")


def lost_peer_line(error: BaseException) -> str | None:
    """The one line for a collective that failed because a peer froze or died, or None if `error`
    is something else. It names the step (RunPosition), the collective the process waited in and
    where, and the troubleshooting section."""
    from torch.distributed.checkpoint.api import CheckpointException

    if not isinstance(error, (RuntimeError, CheckpointException)):
        return None
    text = str(error).lower()
    if any(sign in text for sign in TIMEOUT_SIGNS):
        seconds = f"{RunPosition.collective_timeout:g} s" if RunPosition.collective_timeout else "too long"
        what = f"waited {seconds} for a peer that did not answer (it froze, was stopped, or is far too slow)"
    elif any(sign in text for sign in GONE_SIGNS):
        what = "lost its connection to a peer (it died or was killed: its own output says why)"
    else:
        return None
    rank = f"rank {torch.distributed.get_rank()}" if torch.distributed.is_initialized() else "this process"
    # gloo's own words, without its source location ("[.../unbound_buffer.cc:78] Timed out ...")
    detail = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip().splitlines()[0] if str(error).strip() else "")
    return (
        f"error: {RunPosition.describe()}: {collective_waited_for(error)} {what}; seen by {rank}"
        f" ({detail[:160] or type(error).__name__}). Continue with --resume_from_checkpoint auto once every"
        ' process can run (docs/troubleshooting.md, "A peer did not answer, or was lost")'
    )


def collective_waited_for(error: BaseException) -> str:
    """Which collective the process was waiting in, and where in our code, from the traceback: the
    innermost torch.distributed call; else backward (DDP's gradient all-reduce runs in C++ hooks);
    else what StepFeed said it was waiting for (an asynchronous all-reduce's wait())."""
    frames = traceback.extract_tb(error.__traceback__)
    scripts_dir = str(Path(__file__).resolve().parents[1])
    ours = [f for f in frames if f.filename.startswith(scripts_dir)]
    where = f" at {Path(ours[-1].filename).name}:{ours[-1].lineno}" if ours else ""
    c10d = [f.name for f in frames if f.filename.endswith("distributed_c10d.py") and not f.name.startswith("_")]
    torch_dist = [f.name for f in frames if f"{os.sep}torch{os.sep}distributed{os.sep}" in f.filename]
    if c10d:
        name = c10d[-1]
    elif any(f"{os.sep}torch{os.sep}autograd{os.sep}" in f.filename for f in frames):
        name = "all_reduce (gradient sync in backward)"
    elif RunPosition.waiting:
        name = RunPosition.waiting
    elif torch_dist:
        name = f"a collective (in torch.distributed's {torch_dist[-1]})"
    else:
        name = "a collective"
    return name + where


def report_to_launcher(message: str) -> None:
    """Under torchrun (and `accelerate launch`, which runs torchrun), a failed worker ends in the
    launcher's traceback and failure table. The table shows what the worker wrote to its
    TORCHELASTIC_ERROR_FILE: writing our one line there makes the table's last lines repeat it,
    instead of "To enable traceback see: ..." (docs/troubleshooting.md, "A traceback after the error line")."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        try:
            with open(path, "w") as f:
                json.dump({"message": message, "timestamp": int(time.time())}, f)
        except OSError:
            pass


def world_size_from_env() -> int:
    """How many processes the launcher started (torchrun sets WORLD_SIZE, mpirun PMI_SIZE ...)."""
    for var in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"):
        if var in os.environ:
            return int(os.environ[var])
    return 1


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the docstring's pictures as they are and shows each real default once: not for
    switches (off unless given) nor where the default is None (the help text says what then)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser(description: str) -> argparse.ArgumentParser:
    """The core flags every training script shares; scripts add their own."""
    p = argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)
    g = p.add_argument_group("run")
    g.add_argument("--output_dir", default=None, help="everything the run writes goes here (default: runs/<strategy>)")
    g.add_argument(
        "--overwrite_output_dir", action="store_true", help="start a new run in an --output_dir that already holds one"
    )
    g.add_argument("--max_steps", type=int, default=1500, help="optimizer steps to run")
    g.add_argument(
        "--stop_at_step",
        type=int,
        help="end this run at step N with a checkpoint, the schedule still aiming at --max_steps "
        "(jobs with a time limit)",
    )
    g.add_argument("--seed", type=int, default=0, help="fixes init, data order and dropout")
    g.add_argument("--cpu", action="store_true", help="run on CPU even where CUDA exists")
    g.add_argument(
        "--collective_timeout",
        type=float,
        default=300,
        help="seconds a collective may wait for a peer before the run fails "
        "(a dead peer ends the run instead of hanging it)",
    )
    g = p.add_argument_group("batch and optimizer")
    g.add_argument("--batch_size", type=int, default=64, help="micro-batch per data-parallel rank")
    g.add_argument("--gradient_accumulation_steps", type=int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--optimizer", default="adamw", help="adamw | sgd (plain SGD, no momentum)")
    g.add_argument("--learning_rate", type=float, default=1e-3, help="peak learning rate")
    g.add_argument(
        "--weight_decay", type=float, default=0.1, help="decoupled weight decay on matrices (not biases, norms)"
    )
    g.add_argument(
        "--warmup_steps", type=int, default=100, help="linear warm-up, then cosine decay to 10%% of the peak"
    )
    g.add_argument("--max_grad_norm", type=float, default=1.0, help="clip the global gradient norm (0: no clipping)")
    g = p.add_argument_group("model")
    g.add_argument("--model_size", default="small", help=f"preset: {' | '.join(MODEL_PRESETS)}")
    g.add_argument("--n_layer", type=int, help="override the preset's layer count")
    g.add_argument("--n_head", type=int, help="override the preset's head count")
    g.add_argument("--n_embd", type=int, help="override the preset's width")
    g.add_argument("--block_size", type=int, help="override the preset's context length")
    g.add_argument("--dropout", type=float, help="dropout probability (default: the preset's, 0)")
    g.add_argument(
        "--model_name_or_path",
        help="train a 🤗 transformers causal LM instead of the built-in GPT: a local folder (config, weights, and "
        "its tokenizer if it has one), or a hub name already in the local cache (no download at run time)",
    )
    g.add_argument(
        "--model_config",
        help="build a 🤗 transformers causal LM from a config, randomly initialised, with the byte vocabulary: a "
        "config.json file, or a folder holding one, or a model type such as llama or qwen2 (docs/your-model.md)",
    )
    g.add_argument(
        "--untie_embeddings",
        action="store_true",
        help="give a pretrained 🤗 model that ties its input and output embeddings two copies (tensor and pipeline "
        "parallel cut them differently)",
    )
    g.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile each transformer block (after TP and activation checkpointing, before FSDP): faster "
        "steps after a first one that waits for the compiler",
    )
    g = p.add_argument_group("mixture of experts (the built-in GPT: docs/ep.md)")
    g.add_argument("--n_experts", type=int, default=0, help="experts per MoE layer (0: dense MLPs)")
    g.add_argument("--top_k", type=int, default=2, help="experts each token is sent to")
    g.add_argument("--moe_every", type=int, default=1, help="every n-th block's MLP is a mixture of experts")
    g.add_argument(
        "--expert_hidden", type=int, default=0, help="hidden width of an expert (default 0: 4 x n_embd / top_k)"
    )
    g.add_argument("--shared_expert", action="store_true", help="one more expert that every token goes through")
    g.add_argument("--router_score", default="softmax", help="softmax | sigmoid (gates renormalised over the top k)")
    g.add_argument(
        "--load_balance",
        default="aux_free",
        help="aux_free (a per-expert bias steers the choice) | aux_loss (Switch/GShard loss) | none",
    )
    g.add_argument("--aux_loss_coef", type=float, default=0.01, help="weight of the auxiliary loss (aux_loss)")
    g.add_argument("--bias_update_rate", type=float, default=1e-3, help="step of the expert bias (aux_free)")
    g.add_argument(
        "--capacity_factor",
        type=float,
        help="drop token copies beyond capacity_factor x tokens x top_k / n_experts per expert (default: none dropped)",
    )
    g.add_argument("--dump_routing", metavar="DIR", help="debug: save each rank's first-step expert choices to DIR")
    add_data_args(p)
    g = p.add_argument_group("logging, evaluation, checkpoints")
    g.add_argument("--log_every", type=int, default=10, help="write a train record every N steps")
    g.add_argument("--eval_every", type=int, default=250, help="evaluate every N steps (0: only at the end)")
    g.add_argument("--eval_batch_size", type=int, default=250, help="evaluation batch per process")
    g.add_argument(
        "--checkpoint_every",
        type=int,
        default=0,
        help="save a resumable checkpoint every N steps (0: only the final model)",
    )
    g.add_argument("--keep_last", type=int, default=2, help="keep the newest N checkpoints (0: keep all)")
    g.add_argument(
        "--resume_from_checkpoint",
        help="'latest' (newest in OUTPUT_DIR/checkpoints), 'auto' (latest if there is one, else start from step 0: "
        "for restarts and requeued jobs), or a checkpoint directory",
    )
    g.add_argument("--report_to", default="none", help="Accelerate trackers: none | tensorboard | wandb | all ...")
    g.add_argument("--peak_flops", type=float, help="the device's peak FLOP/s, for MFU (default: known GPUs only)")
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
    if args.optimizer not in ("adamw", "sgd"):
        raise UsageError(f"--optimizer {args.optimizer!r} is not supported: use adamw or sgd")
    if args.model_name_or_path and args.model_config:
        raise UsageError(
            "--model_name_or_path and --model_config both name a model: give one (a pretrained folder, or a config "
            "to build from)"
        )
    if getattr(args, "n_experts", 0) and (args.model_name_or_path or args.model_config):
        raise UsageError(
            f"--n_experts {args.n_experts} turns the built-in GPT's MLPs into experts, but a 🤗 model "
            "(--model_name_or_path, --model_config) brings its own: drop --n_experts (train_ep.py trains the built-in "
            "GPT only: train a 🤗 model with train_fsdp.py)"
        )
    script = Path(sys.argv[0]).name
    if getattr(args, "n_experts", 0) and script.startswith("train_") and script not in MOE_SCRIPTS:
        raise UsageError(
            f"--n_experts: {script} does not train a mixture of experts yet; use train_ep.py (expert parallel), "
            "train_fsdp.py or train_ddp.py"
        )
    if args.model_size not in MODEL_PRESETS:
        raise UsageError(f"--model_size {args.model_size!r} is not a preset: choose {', '.join(MODEL_PRESETS)}")
    for flag in ("n_layer", "n_head", "n_embd", "block_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag} must be at least 1 (got {value})")
    if args.dropout is not None and not 0 <= args.dropout < 1:
        raise UsageError(f"--dropout must be in [0, 1) (got {args.dropout})")
    if getattr(args, "n_experts", 0):  # the MoE flags (top_k <= n_experts ...), before any process group
        gpt_config_from_args(args)
    if args.output_dir and os.path.exists(args.output_dir) and not os.path.isdir(args.output_dir):
        raise UsageError(f"--output_dir {args.output_dir} is a file, not a folder: give a folder for the run's outputs")
    check_data_args(args)


# The training scripts that train the GPT with MoE layers (docs/ep.md); the others refuse --n_experts.
MOE_SCRIPTS = ("train_ddp.py", "train_fsdp.py", "train_ep.py")


def check_launch() -> None:
    """docs/troubleshooting.md, "Only one process started": `accelerate launch --cpu --num_processes 2`,
    or a MULTI_CPU config
    without an mpirun hostfile, starts ONE process. The launcher leaves a trace: it sets
    MASTER_ADDR (only done when asked for more than one process or machine) and
    ACCELERATE_USE_CPU (only its single-process launcher does), but no WORLD_SIZE."""
    asked_for_more = "MASTER_ADDR" in os.environ and "ACCELERATE_USE_CPU" in os.environ
    if asked_for_more and world_size_from_env() == 1:
        raise UsageError(
            "accelerate launch was asked for several processes but started only one (a --cpu or MULTI_CPU launch "
            "without an mpirun hostfile does that): use --config_file accelerate_configs/cpu_multi.yaml, "
            "or --multi_gpu --num_processes N"
        )


def launcher_sharding() -> str | None:
    """The sharded strategy an Accelerate config asked for (FSDP, DeepSpeed, Megatron-LM), if any.
    Read from the launcher's environment: on CPU Accelerate silently drops an FSDP config
    (docs/troubleshooting.md, "Accelerate's FSDP config is ignored on CPU"), so the Accelerator's state
    would not tell."""
    return next(
        (
            name
            for name in ("FSDP", "DEEPSPEED", "MEGATRON_LM")
            if os.environ.get(f"ACCELERATE_USE_{name}", "false").lower() == "true"
        ),
        None,
    )


def make_accelerator(args, cpu: bool | None = None, sharded: bool = False, **accelerator_kwargs):
    """The Accelerator, with the CPU traps handled:
    - "Several processes that each think they are alone" (docs/troubleshooting.md): a torchrun-style
      launch (`--multi_gpu`, MULTI_GPU config) on a machine without
      CUDA starts N processes that each think they are alone, unless told to use the CPU:
      the scripts pass cpu=True whenever CUDA is missing (the default here too), and they join one
      gloo process group; if they still do not, the run stops with one line;
    - the collective timeout: a dead peer fails the run after `--collective_timeout` s."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    check_launch()
    expected = world_size_from_env()
    if "OMP_NUM_THREADS" not in os.environ:  # torchrun sets it to 1; a plain `python` run shares the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))))
    use_cpu = cpu if cpu is not None else (args.cpu or not torch.cuda.is_available())
    RunPosition.collective_timeout = args.collective_timeout
    init_restart_safe_group(use_cpu, timedelta(seconds=args.collective_timeout))
    accelerator = Accelerator(
        cpu=use_cpu,
        log_with=None if args.report_to == "none" else args.report_to,
        project_dir=args.output_dir,
        kwargs_handlers=[
            InitProcessGroupKwargs(timeout=timedelta(seconds=args.collective_timeout)),
            *accelerator_kwargs.pop("kwargs_handlers", []),
        ],
        **accelerator_kwargs,
    )
    if accelerator.num_processes != expected:  # never N silent single-process runs
        raise UsageError(
            f"the launcher started {expected} processes but they did not join one group (each sees "
            f"{accelerator.num_processes}): launch with accelerate launch --config_file "
            "accelerate_configs/cpu_multi.yaml"
        )
    if sharded:
        check_sharded_launch(accelerator, Path(sys.argv[0]).name)
        init_one_process_group(accelerator)
    return accelerator


def init_restart_safe_group(use_cpu: bool, timeout: timedelta) -> None:
    """Under torchrun the workers share the launcher's key-value store, and it outlives a restart
    (`--max_restarts`): the new workers would find the dead ones' addresses in it and fail to
    connect ("Gloo connectFullMesh failed ... Connection refused"). So the process group is made
    here, on a view of the store named after the attempt; Accelerate then uses it as it is."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or torch.distributed.is_initialized():
        return
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = torch.distributed.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    torch.distributed.init_process_group(
        "gloo" if use_cpu else "nccl",
        store=torch.distributed.PrefixStore(f"attempt_{attempt}", store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timeout,
    )


def check_sharded_launch(accelerator, script: str) -> None:
    """A script that applies its strategy itself refuses a launch that also asks Accelerate for
    one (it would shard twice on GPUs, and be silently dropped on CPU: docs/troubleshooting.md,
    "Accelerate's FSDP config is ignored on CPU"), and fp16, whose loss scaler does not handle
    sharded gradients."""
    sharded = launcher_sharding()
    if sharded:
        raise UsageError(
            f"{script} applies its strategy itself with PyTorch's APIs, but the launch also asked Accelerate for "
            f"{sharded}: launch with a plain multi-process config, e.g. --config_file "
            "accelerate_configs/cpu_multi.yaml (or gpu_multi.yaml)"
        )
    if accelerator.mixed_precision == "fp16":
        raise UsageError(
            "--mixed_precision fp16 is not supported by the sharded strategies (its loss scaler does not handle "
            "sharded gradients): launch with --mixed_precision bf16 or no"
        )


def init_one_process_group(accelerator) -> None:
    """A DeviceMesh needs a process group, but `python scripts/X.py` and a one-process launch
    create none (Accelerate needs none for one process): make a one-process group, in memory
    (docs/troubleshooting.md, "A sharded script run as one process")."""
    if torch.distributed.is_initialized():
        return
    backend = "cpu:gloo,cuda:nccl" if accelerator.device.type == "cuda" else "gloo"
    torch.distributed.init_process_group(
        backend,
        store=torch.distributed.HashStore(),
        rank=0,
        world_size=1,
        device_id=accelerator.device if accelerator.device.type == "cuda" else None,
    )
