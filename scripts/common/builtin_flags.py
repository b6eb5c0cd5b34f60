"""The flags of the built-in data sets and models: the GPT's size, its mixture of experts, 🤗 models, and
the data (addition, pystdlib, hub data sets, your files), with the checks that need nothing but flags.
A script adds them in its flags section (add_builtin_flags); a copy for a model and data of your own
drops that line, and carries none of this. Nothing here imports a model or a data set."""

from __future__ import annotations

import argparse
from pathlib import Path

from .errors import UsageError
from .presets import MODEL_PRESETS

DEFAULT_CACHE_DIR = Path(__file__).resolve().parents[2] / "data" / "cache"
BUILTIN_DATASETS = ("addition", "pystdlib")
FILE_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".csv": "csv"}  # --train_file types
SOURCE_DEFAULTS = {"dataset": "addition", "addition_digits": 3, "text_column": "text", "document_mask": False}


def add_builtin_flags(parser, moe: bool = False) -> None:
    """The built-in models' flags and the data flags. `moe`: the script trains the built-in GPT's mixture
    of experts (its flags are listed); without it --n_experts is refused with one line naming the scripts
    that do."""
    add_model_args(parser, moe)
    add_data_args(parser)


def check_builtin_flags(args) -> None:
    """The checks of add_builtin_flags' flags (common/cli.py's check_core_args runs them)."""
    check_model_args(args)
    check_data_args(args)


def add_model_args(parser, moe: bool) -> None:
    """The built-in models' flags: the GPT's size, a 🤗 model instead, and (`moe`) the GPT's experts."""
    g = parser.add_argument_group("model")
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
    if not moe:  # accepted only to be refused with one line (check_core_args), not listed
        parser.add_argument("--n_experts", type=int, default=0, help=argparse.SUPPRESS)
        parser.set_defaults(trains_moe=False)
        return
    parser.set_defaults(trains_moe=True)
    g = parser.add_argument_group("mixture of experts (the built-in GPT: docs/ep.md)")
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


def check_model_args(args) -> None:
    """The built-in models' flags, one line each."""
    if args.model_name_or_path and args.model_config:
        raise UsageError(
            "--model_name_or_path and --model_config both name a model: give one (a pretrained folder, or a config "
            "to build from)"
        )
    if args.n_experts and (args.model_name_or_path or args.model_config):
        raise UsageError(
            f"--n_experts {args.n_experts} turns the built-in GPT's MLPs into experts, but a 🤗 model "
            "(--model_name_or_path, --model_config) brings its own, set in its config: drop --n_experts (train_ep.py "
            "trains a 🤗 MoE family's experts as they are)"
        )
    if args.n_experts and not args.trains_moe:
        raise UsageError(
            "--n_experts: this script does not train a mixture of experts yet; use train_ep.py (expert parallel), "
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
    if args.n_experts:  # the MoE flags (top_k <= n_experts ...), before any process group: only the GPT knows them
        from .presets import gpt_config_from_args

        gpt_config_from_args(args)


# ---------------------------------------------------------------- the data flags
def add_data_args(parser, defaults_from_model: bool = False) -> None:
    """The data flags. With `defaults_from_model` (evaluate.py) the flags that say which data a
    model learned have no default of their own: the caller fills them from model/data.json."""
    default = dict.fromkeys(SOURCE_DEFAULTS) if defaults_from_model else SOURCE_DEFAULTS
    model = " (default: the model's, from --model_dir's data.json)" if defaults_from_model else ""
    trained_on = model and " (default: the data set the model was trained on, from --model_dir's data.json)"
    g = parser.add_argument_group("data")
    builtin = " | ".join(BUILTIN_DATASETS)
    g.add_argument("--dataset", default=default["dataset"], help=f"built-in data set: {builtin}{trained_on}")
    digits = default["addition_digits"]
    g.add_argument("--addition_digits", type=int, default=digits, help=f"digits per operand of the addition set{model}")
    hub = "a 🤗 hub data set (or a local folder laid out like one); replaces --dataset"
    g.add_argument("--dataset_name", help=hub + model)
    g.add_argument("--dataset_config", help=f"configuration name of --dataset_name{model}")
    column = "column holding the text (hub and local files)"
    g.add_argument("--text_column", default=default["text_column"], help=column + model)
    g.add_argument("--train_file", help=f"local training file: .txt, .json/.jsonl or .csv; replaces --dataset{model}")
    held_out = "the last 5%% of --train_file"
    validation = f"the model's, from --model_dir's data.json; if none, {held_out}" if defaults_from_model else held_out
    g.add_argument("--validation_file", help=f"local validation file (default: {validation})")
    first = "evaluate on the first N validation samples only (default: all): quicker evaluations of a large split"
    g.add_argument("--max_eval_samples", type=int, metavar="N", help=first)
    g.add_argument(
        "--document_mask",
        action="store_true",
        default=default["document_mask"],
        help="text packed from several documents per block: each token attends within its own document only, and "
        "positions restart at each document (as Llama 3 and torchtitan train); a document is a row of the data "
        f"(a pystdlib source file, a json/csv row, a hub data set's row){model} (docs/data.md)",
    )
    g.add_argument("--data_cache_dir", default=str(DEFAULT_CACHE_DIR), help="where built data and 🤗 caches go")


def check_max_eval_samples(args) -> None:
    if args.max_eval_samples is not None and args.max_eval_samples < 1:
        raise UsageError(f"--max_eval_samples must be at least 1 (got {args.max_eval_samples}): leave it out for all")


def check_data_args(args) -> None:
    """Checks that need no data: run before any process group exists."""
    check_max_eval_samples(args)
    if args.validation_file and not args.train_file:
        raise UsageError("--validation_file needs --train_file: pass the training file too")
    for flag in ("train_file", "validation_file"):
        path = getattr(args, flag)
        if path is None:
            continue
        if not Path(path).is_file():
            raise UsageError(f"--{flag} {path}: no such file")
        if Path(path).suffix not in FILE_BUILDERS:
            raise UsageError(f"--{flag} {path}: unsupported type (use {', '.join(FILE_BUILDERS)})")
    if not (args.train_file or args.dataset_name) and args.dataset not in BUILTIN_DATASETS:
        raise UsageError(
            f"--dataset {args.dataset!r} is not a built-in data set (choose {' or '.join(BUILTIN_DATASETS)})"
            ", or use --dataset_name / --train_file"
        )
    if getattr(args, "document_mask", False):
        if not (args.train_file or args.dataset_name) and args.dataset == "addition":
            raise UsageError(
                "--document_mask: the addition set holds one problem per row, never packed, so there is nothing "
                "to mask: use it with text packed from documents (--dataset pystdlib, --train_file, --dataset_name)"
            )
        if args.train_file and Path(args.train_file).suffix == ".txt":
            raise UsageError(
                f"--document_mask: the rows of a .txt file ({args.train_file}) are its lines, not documents: give "
                "one document per row of a .jsonl or .csv file (--train_file), or a data set (--dataset_name)"
            )
    if args.addition_digits < 1 or args.addition_digits > 9:
        raise UsageError(f"--addition_digits must be 1..9 (got {args.addition_digits})")
