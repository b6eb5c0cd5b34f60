"""Tiny configs of 🤗 families beyond the zoo's (tests/zoo_configs.py FAMILIES), for the tests that check
every family without training it in every script: the meta-device build (test_hf_init.py), Falcon under
context parallelism. Kept apart from FAMILIES so the zoo's table keeps its cells.

Each keeps what makes its family itself: Qwen3-Next's and Qwen3.5-MoE's gated DeltaNet layers mixed with
attention and their routers (initialised by the MoE block, which owns no parameter itself), BLOOM's ALiBi,
Falcon's multi-query attention with rotary positions, Gemma 2's and Cohere 2's sliding windows and
soft-capping, Starcoder 2's biases, Qwen2-MoE's shared expert and its gate, GLM-4-MoE's grouped routing,
LFM2's short convolutions. The third batch: GPT-2 (learned positions, no plans), OPT (its layers a floor down),
MPT (ALiBi in its own attention), GPT-Neo's local attention, XGLM's sinusoidal positions, Granite's multipliers,
RecurrentGemma's RG-LRU, Mamba (no attention at all), Falcon-H1 and Jamba (Mamba mixed with attention), MiniMax's
linear attention, Llama 4's chunked attention and no-RoPE layers (its base model under another name), JetMoE's
and Llama 4's experts that transformers names for no expert parallelism, PhiMoE's router."""

from zoo_configs import DENSE

MOE_SMALL = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
LINEAR_ATTENTION = {
    "head_dim": 8,
    "layer_types": ["linear_attention", "full_attention"] * 2,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "shared_expert_intermediate_size": 32,
}
NO_PDROP = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
WINDOWED = {"head_dim": 8, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"] * 2}

MORE_FAMILIES = {
    "qwen3_next": {**DENSE, **MOE_SMALL, **LINEAR_ATTENTION},
    "qwen3_5_moe_text": {**DENSE, **MOE_SMALL, **LINEAR_ATTENTION},
    "bloom": {"hidden_size": 64, "n_layer": 4, "n_head": 8},
    "falcon": {
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "ffn_hidden_size": 128,
        "max_position_embeddings": 64,
    },
    "gemma2": {**DENSE, **WINDOWED, "query_pre_attn_scalar": 16},
    "cohere2": {**DENSE, **WINDOWED},
    "starcoder2": {**DENSE},
    "qwen2_moe": {**DENSE, **MOE_SMALL, "shared_expert_intermediate_size": 32},
    "glm4_moe": {
        **DENSE,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
    },
    "lfm2": {**DENSE, "layer_types": ["conv", "full_attention"] * 2},
    # the third batch: each config's dropouts 0 (GPT-2's, XGLM's, GPT-Neo's defaults are not)
    "gpt2": {"n_embd": 64, "n_layer": 4, "n_head": 8, "n_positions": 64, **NO_PDROP},
    "opt": {
        "hidden_size": 64,
        "ffn_dim": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "max_position_embeddings": 64,
        "word_embed_proj_dim": 64,
        "dropout": 0.0,
        "attention_dropout": 0.0,
    },
    "mpt": {"d_model": 64, "n_heads": 8, "n_layers": 4, "max_seq_len": 64},
    "gpt_neo": {
        "hidden_size": 64,
        "num_layers": 4,
        "num_heads": 8,
        "max_position_embeddings": 64,
        "intermediate_size": 128,
        "window_size": 8,
        "attention_types": [[["global", "local"], 2]],
        "resid_dropout": 0.0,
        "embed_dropout": 0.0,
        "attention_dropout": 0.0,
    },
    "xglm": {
        "d_model": 64,
        "num_layers": 4,
        "attention_heads": 8,
        "ffn_dim": 128,
        "max_position_embeddings": 64,
        "dropout": 0.0,
        "attention_dropout": 0.0,
        "activation_dropout": 0.0,
        "layerdrop": 0.0,
    },
    "granite": {
        **DENSE,
        "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22,
        "attention_multiplier": 0.015625,
        "logits_scaling": 8.0,
    },
    "recurrent_gemma": {
        **DENSE,
        "lru_width": 64,
        "attention_window_size": 8,
    },
    "mamba": {"hidden_size": 64, "num_hidden_layers": 4, "state_size": 8, "expand": 2},
    "falcon_h1": {
        **DENSE,
        "head_dim": 8,
        "mamba_d_ssm": 64,
        "mamba_n_heads": 8,
        "mamba_d_head": 8,
        "mamba_d_state": 8,
        "mamba_n_groups": 1,
    },
    "jamba": {
        **DENSE,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "mamba_d_state": 8,
        "use_mamba_kernels": False,
    },
    "minimax": {
        **DENSE,
        "head_dim": 8,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "layer_types": ["linear_attention", "full_attention"] * 2,
    },
    "llama4_text": {
        **DENSE,
        "head_dim": 8,
        "attention_chunk_size": 8,
        "num_local_experts": 4,
        "num_experts_per_tok": 1,
        "intermediate_size_mlp": 128,
        "interleave_moe_layer_step": 2,
        "no_rope_layers": [1, 0, 1, 0],
    },
    "jetmoe": {
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_key_value_heads": 4,
        "kv_channels": 8,
        "intermediate_size": 128,
        "max_position_embeddings": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    },
    "phimoe": {**DENSE, "num_local_experts": 4, "num_experts_per_tok": 2, "router_jitter_noise": 0.0},
}


def write_more_configs(folder, families=None) -> dict:
    """{family: path of its JSON config} written under `folder` (all of MORE_FAMILIES, or those named)."""
    import json
    from pathlib import Path

    paths = {}
    for family in families or MORE_FAMILIES:
        paths[family] = Path(folder) / f"{family}.json"
        paths[family].write_text(json.dumps({"model_type": family, **MORE_FAMILIES[family]}))
    return paths
