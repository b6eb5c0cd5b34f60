"""The cut check of a model too large for one rank: the same script, run again in the same processes up
to its cut check, on a shrunken copy of the architecture (the same config, fewer layers, narrow), so the
cut that is proven is the one the run makes, and the line says that the copy was shrunken.

    full model: 80 layers x 8192 wide (too large to copy)    ->  the check: 8 layers x 8 per head
    the script: MODEL section, strategy, check_cut  ...  step 1  (its check_cut returns here: no step)

A 🤗 model shrinks by its config (the same family, heads, experts, layer types; widths of 8 per head);
the built-in GPT by --n_layer and --n_embd; a model of one's own cannot be shrunk here: its check is
skipped, and the line says why."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from .errors import UsageError
from .run_state import RunPosition

HEAD = 8  # the shrunken copy's width per attention head
WIDTHS = ("hidden_size", "n_embd", "d_model")  # the model's width, by the names families give it
LAYERS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")  # MPT: n_layers; XGLM, GPT-Neo: num_layers
HEADS = ("num_attention_heads", "n_head", "n_heads", "num_heads", "attention_heads")
PER_HEAD = ("head_dim", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "linear_key_head_dim")
PER_HEAD += ("linear_value_head_dim", "kv_channels")
FFN = ("intermediate_size", "ffn_hidden_size", "n_inner", "ffn_dim")  # 2 x width
EXPERT_FFN = ("moe_intermediate_size", "shared_expert_intermediate_size")  # 32: many experts stay small
RANKS = ("q_lora_rank", "kv_lora_rank")  # low-rank projections (DeepSeek's MLA): 2 heads' width
DROPPED = ("--output_dir", "--resume_from_checkpoint", "--model_name_or_path", "--model_config", "--report_to")


class ShrunkenChecked(Exception):
    """Raised by check_cut in a shrunken copy's run (RunPosition.shrunken_copy), with its start line: that run
    stops there."""


def shrunk_layers(n_layers: int) -> int:
    """Every rank keeps layers (a pipeline stage per rank, two per rank in a looped schedule)."""
    return min(n_layers, max(4, 2 * int(os.environ.get("WORLD_SIZE", "1"))))


def shrunk_hf_config(config: dict) -> dict:
    """The same 🤗 config, fewer layers and narrow: heads, experts, layer types and vocabulary kept."""
    c = {k: v for k, v in config.items() if k not in ("_name_or_path", "architectures", "auto_map")}
    layers_key = next(k for k in LAYERS if isinstance(c.get(k), int))
    old_layers, c[layers_key] = c[layers_key], shrunk_layers(c[layers_key])
    for key, value in list(c.items()):  # one entry per layer (layer_types): the first layers'
        if isinstance(value, list) and len(value) == old_layers:
            c[key] = value[: c[layers_key]]
    heads = next((c[k] for k in HEADS if isinstance(c.get(k), int)), 8)
    width = 64 if isinstance(c.get("head_dim"), int) else heads * HEAD  # a head's width set apart, or width/heads

    def narrow(keys, size):
        for key in keys:
            if isinstance(c.get(key), int) and c[key] > size:
                c[key] = size

    narrow(WIDTHS, width), narrow(PER_HEAD, HEAD), narrow(FFN, 2 * width), narrow(EXPERT_FFN, 32)
    narrow(RANKS, 2 * HEAD)
    if isinstance(c.get("qk_head_dim"), int):  # DeepSeek's: rope + nope, kept consistent
        c["qk_head_dim"] = c.get("qk_rope_head_dim", 0) + c.get("qk_nope_head_dim", 0)
    return c


def shrunk_flags(model, task, folder: Path) -> tuple[list[str], str] | None:
    """The flags that build the shrunken copy, and its words; None where the model cannot be shrunk."""
    if type(task).__name__ == "GPTTask":  # the built-in GPT
        cfg = task.cfg
        layers, width = shrunk_layers(cfg.n_layer), min(cfg.n_embd, cfg.n_head * HEAD)
        return ["--n_layer", str(layers), "--n_embd", str(width)], f"{layers} layers x {width} wide"
    config = getattr(model, "config", None)
    if hasattr(config, "model_type"):  # a 🤗 model: its config, shrunk, as --model_config
        small = shrunk_hf_config(config.to_dict())
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(small, indent=1))
        layers = next(small[k] for k in LAYERS if k in small)
        width = next(small[k] for k in WIDTHS if k in small)
        return ["--model_config", str(folder / "config.json")], f"{layers} layers x {width} wide"
    return None


def check_shrunken_copy(model, task, n_bytes: int) -> str:
    """Collective: this script's MODEL section, strategy and cut check once more, on the shrunken copy;
    returns the start line's words (or the reason there is no check); raises the check's error."""
    too_large = f"the whole model ({n_bytes / 2**30:.1f} GiB) is too large to copy onto one rank"
    folder = Path(RunPosition.output_dir or ".") / ".shrunken_cut_check"
    flags = shrunk_flags(model, task, folder)
    if flags is None:
        return f"cut check: skipped ({too_large}; a model of one's own is checked whole only): nothing proves the cut"
    script_main = getattr(sys.modules["__main__"], "main", None)
    if script_main is None:
        return f"cut check: skipped ({too_large}; the script has no main() to run on a shrunken copy)"
    argv, kept = sys.argv, {k: getattr(RunPosition, k) for k in ("output_dir", "started", "collective_timeout")}
    words = f"on a shrunken copy, {flags[1]}: the whole model is too large for one rank"
    sys.argv = _without(argv[1:], DROPPED) + flags[0] + ["--output_dir", str(folder), "--overwrite_output_dir"]
    sys.argv.insert(0, argv[0])
    RunPosition.shrunken_copy = words
    start = time.perf_counter()
    try:
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
            script_main()  # the lesson itself: it stops at its cut check (ShrunkenChecked)
        raise UsageError(f"{argv[0]}: its run on a shrunken copy ended before check_cut(...): keep that line")
    except ShrunkenChecked as done:
        return f"{done} (its run {time.perf_counter() - start:.1f} s)"
    finally:
        sys.argv, RunPosition.shrunken_copy = argv, None
        for key, value in kept.items():
            setattr(RunPosition, key, value)
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            shutil.rmtree(folder, ignore_errors=True)


def _without(args: list[str], flags: tuple) -> list[str]:
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in flags:
            skip = True  # its value follows
        elif not arg.startswith(tuple(f + "=" for f in flags)):
            kept.append(arg)
    return kept
