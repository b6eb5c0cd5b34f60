"""Tiny configs of 🤗 families beyond the zoo's (tests/zoo_configs.py FAMILIES), for the tests that check
every family without training it in every script: the meta-device build (test_hf_init.py), Falcon under
context parallelism. Kept apart from FAMILIES so the zoo's table keeps its cells.

Each keeps what makes its family itself: Qwen3-Next's and Qwen3.5-MoE's gated DeltaNet layers mixed with
attention and their routers (initialised by the MoE block, which owns no parameter itself), BLOOM's ALiBi,
Falcon's multi-query attention with rotary positions, Gemma 2's and Cohere 2's sliding windows and
soft-capping, Starcoder 2's biases, Qwen2-MoE's shared expert and its gate, GLM-4-MoE's grouped routing,
LFM2's short convolutions."""

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
