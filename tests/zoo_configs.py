"""Tiny configs of the 🤗 families the zoo tests train (random init, the byte vocabulary, no download).

Each keeps what makes its family itself: grouped KV heads, Qwen3's per-head q/k norms, Mistral's and
Gemma 3's sliding windows (shorter than the 16-token rows, so the window is a real mask), Gemma 3's mixed
layer types and query scaling, Phi-3's fused qkv / gate_up projections, GPT-NeoX's layout
(gpt_neox.layers, embed_in, embed_out) and partial rotary, and the MoE families' routers: Mixtral's and
Qwen3-MoE's top-k softmax, DeepSeek-V3's shared expert, grouped bias-corrected routing and multi-head
latent attention, gpt-oss's attention sinks and expert biases."""

DENSE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 64,
}
MOE = {"num_local_experts": 4, "num_experts_per_tok": 2}

FAMILIES = {
    "llama": {**DENSE},
    "qwen3": {**DENSE, "head_dim": 8},
    "mistral": {**DENSE, "sliding_window": 8},
    "gemma3_text": {
        **DENSE,
        "head_dim": 8,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "query_pre_attn_scalar": 16,
    },
    # the same with a window as long as the rows: Gemma 3's own score scale (query_pre_attn_scalar) under CP
    "gemma3_text_window16": {
        **DENSE,
        "head_dim": 8,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "query_pre_attn_scalar": 16,
    },
    "phi3": {**DENSE},
    "gpt_neox": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "max_position_embeddings": 64,
        "rotary_pct": 0.5,
    },
    "mixtral": {**DENSE, **MOE},
    "qwen3_moe": {
        **DENSE,
        "head_dim": 8,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "deepseek_v3": {
        **DENSE,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "moe_intermediate_size": 64,
        "first_k_dense_replace": 1,
        "n_group": 2,
        "topk_group": 1,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 8,
        "num_key_value_heads": 8,
    },
    "gpt_oss": {
        **DENSE,
        "head_dim": 8,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 150000.0},
    },
}
MOE_FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")


def write_configs(folder) -> dict:
    """{family: path of its JSON config} written under `folder`."""
    import json
    from pathlib import Path

    paths = {}
    for family, values in FAMILIES.items():
        paths[family] = Path(folder) / f"{family}.json"
        model_type = family.removesuffix("_window16")
        paths[family].write_text(json.dumps({"model_type": model_type, **values}))
    return paths
