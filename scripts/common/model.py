"""Which language model a run trains, read from the built-in flags: the built-in GPT (common/gpt.py,
its config in common/presets.py), or a 🤗 transformers causal LM (common/hf.py, imported only then).
The lessons' MODEL sections call language_model; the data section context_length and tokenizer_for."""

from __future__ import annotations

import torch.nn as nn

from .causal_lm import CausalLMTask
from .gpt import GPT, Block, CausalSelfAttention, GPTStage, GPTTask, causal_attention, flops_per_token, moe_mlp
from .presets import (
    DENSE_FIELDS,
    MOE_FLAGS,
    VOCAB_SIZE,
    GPTConfig,
    check_gpt_split,
    check_moe_config,
    gpt_config_from_args,
)

__all__ = [  # the built-in GPT's names, where every caller has always found them
    "DENSE_FIELDS",
    "MOE_FLAGS",
    "VOCAB_SIZE",
    "GPT",
    "Block",
    "CausalSelfAttention",
    "GPTConfig",
    "GPTStage",
    "GPTTask",
    "causal_attention",
    "check_gpt_split",
    "check_moe_config",
    "context_length",
    "flops_per_token",
    "gpt_config_from_args",
    "language_model",
    "moe_mlp",
    "tokenizer_for",
]


def context_length(args) -> int:
    """The longest sequence the model takes (what the data is cut to), before the model exists."""
    if getattr(args, "model_name_or_path", None) or getattr(args, "model_config", None):
        from .hf import hf_context_length  # only a 🤗 model needs the 🤗 code

        return hf_context_length(args)
    return gpt_config_from_args(args).block_size


def tokenizer_for(args):
    """The tokenizer of a pretrained 🤗 model folder that has one; None: the byte vocabulary (the GPT,
    and models built from a config)."""
    if getattr(args, "model_name_or_path", None):
        from .hf import load_tokenizer  # only a 🤗 model needs the 🤗 code

        return load_tokenizer(args)
    return None


def language_model(args, data, on_meta: bool = False) -> tuple[nn.Module, CausalLMTask]:
    """The built-in GPT (--model_size and overrides), or a 🤗 transformers causal LM
    (--model_name_or_path, --model_config), and its Task. Seed first: every rank builds the same
    full model before any strategy cuts it. `on_meta`: a 🤗 model comes on the meta device, its weights
    made after the strategy has cut it (common/hf.py materialize_hf); the GPT is built whole."""
    if getattr(args, "lora_r", 0):  # LoRA: the base made whole, frozen, and the adapters beside it
        from .lora import apply_lora

        return apply_lora(*_language_model(args, data, on_meta=False), args)
    return _language_model(args, data, on_meta)


def _language_model(args, data, on_meta: bool) -> tuple[nn.Module, CausalLMTask]:
    if getattr(args, "model_name_or_path", None) or getattr(args, "model_config", None):
        from .hf import load_hf_model  # only a 🤗 model needs the 🤗 code

        return load_hf_model(args, data.seq_len, data.task, on_meta=on_meta)
    cfg = gpt_config_from_args(args)
    model = GPT(cfg)
    if cfg.n_experts:
        from .moe import moe_layers

        for moe in moe_layers(model):
            moe.dump_routing = getattr(args, "dump_routing", None)  # debug: the first step's expert choices
    return model, GPTTask(cfg, data.seq_len, data.task, args.model_size)
