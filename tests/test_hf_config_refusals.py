"""🤗 configs that transformers accepts, or fails on with a traceback, refused before anything is written in one
`error:` line naming the field and the fix (issue 42): a field of the wrong type, heads that do not divide the
hidden size (checked by the config, or by BLOOM only when the model is built), KV heads that do not divide the
query heads, a sliding window of 0 or fewer tokens on a layer that uses it (transformers' sdpa and eager disagree
on it, its KV cache fails: one process and Ulysses trained 3.6e-2 apart); and under context parallelism, Falcon,
whose layers compute attention themselves (its forward failed with a TypeError at set-up), and attention dropout
under any config name (found by a forward in training mode, not by the field's name); and a layer drop on more
than one data-parallel rank (found by which layers run)."""

import argparse
import json
import sys

import pytest
from more_zoo_configs import MORE_FAMILIES, write_more_configs

from conftest import SCRIPTS, TINY, run_in_turn, run_refused

sys.path.insert(0, str(SCRIPTS))
from common.hf import load_hf_model

DENSE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 64,
}
FLAGS = [*TINY, "--max_steps", "2", "--addition_digits", "4", "--batch_size", "16"]
# name -> (config, words the one line must hold)
BAD_CONFIGS = {
    "quoted number": ({"model_type": "llama", **DENSE, "hidden_size": "64"}, ["field hidden_size", "without quotes"]),
    "fraction of a layer": ({"model_type": "llama", **DENSE, "num_hidden_layers": 2.5}, ["num_hidden_layers", "whole"]),
    "heads": (
        {"model_type": "llama", **DENSE, "num_attention_heads": 5},
        ["num_attention_heads 5", "set num_attention_heads to a divisor of 64"],
    ),
    "heads checked at build": (
        {"model_type": "bloom", "hidden_size": 64, "n_layer": 2, "n_head": 5},
        ["num_attention_heads 5", "set num_attention_heads to a divisor of 64"],
    ),
    "kv heads": ({"model_type": "llama", **DENSE, "num_key_value_heads": 3}, ["num_key_value_heads 3", "1, 2, 4, 8"]),
    "window 0": ({"model_type": "mistral", **DENSE, "sliding_window": 0}, ["sliding_window 0", "a positive number"]),
    "window -3 in sliding layers": (
        {
            "model_type": "gemma3_text",
            **DENSE,
            "head_dim": 8,
            "sliding_window": -3,
            "layer_types": ["sliding_attention", "full_attention"],
        },
        ["sliding_window -3", "a positive number"],
    ),
}


def assert_one_line(result, *needles) -> None:
    errors = [line for line in result["stderr"].splitlines() if line.startswith("error: ")]
    assert result["returncode"] == 2 and len(errors) == 1, f"exit {result['returncode']}:\n{result['stderr'][-3000:]}"
    assert "Traceback" not in result["stderr"], result["stderr"][-3000:]
    for needle in needles:
        assert needle in errors[0], errors[0]


def test_bad_configs_are_one_line_each(tmp_path, data_cache):
    """Each through train_ddp.py, and the windows also through train_cp.py's Ulysses (one process: the check
    comes before any process count matters)."""
    cases, expected = [], []
    for i, (name, (config, needles)) in enumerate(BAD_CONFIGS.items()):
        path = tmp_path / f"config{i}.json"
        path.write_text(json.dumps(config))
        scripts = ["train_ddp.py", "train_cp.py"] if name.startswith("window") else ["train_ddp.py"]
        for script in scripts:
            flags = ["--cp_impl", "ulysses"] if script == "train_cp.py" else []
            out = tmp_path / f"run{len(cases)}"
            args = [*FLAGS, *flags, "--model_config", path, "--data_cache_dir", data_cache, "--output_dir", out]
            cases.append((script, args))
            expected.append((name, script, needles, out))
    for result, (name, script, needles, out) in zip(run_refused(cases), expected, strict=True):
        assert_one_line(vars(result), *needles)
        assert not out.exists(), f"{name} ({script}) wrote {out}"


def test_an_unused_window_of_0_builds(tmp_path):
    """Qwen2-MoE's own default: sliding_window 0 with every layer full attention (use_sliding_window false)."""
    config = {"model_type": "qwen2_moe", **DENSE, "num_experts": 4, "num_experts_per_tok": 2}
    (tmp_path / "qwen2_moe.json").write_text(json.dumps({**config, "moe_intermediate_size": 32}))
    args = argparse.Namespace(model_config=str(tmp_path / "qwen2_moe.json"), model_name_or_path=None)
    model, _ = load_hf_model(args, 16, "text", tokenizer=None)
    assert model.config.sliding_window == 0


# attention dropout under the names families give it; the ring and Ulysses cannot apply it, and the
# check that knew one name let GPT-2's attn_pdrop through (cp 2 trained 1.8e-2 from one process)
DROPPING_ATTENTION = {
    "gpt2": {
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 8,
        "n_positions": 64,
        "attn_pdrop": 0.1,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
    },
    "llama": {**DENSE, "attention_dropout": 0.1},
}


@pytest.mark.xdist_group("falcon_cp")
def test_what_the_ranks_cannot_compute_together_is_refused_in_one_line(tmp_path, data_cache):
    """Falcon, whose layers compute attention themselves, under the ring and Ulysses; attention dropout under
    two config names, through train_cp.py and train_hybrid.py; XGLM's layer drop, which skips other layers on
    each data-parallel rank (DDP raised at step 2, FSDP waited out its collective timeout), through
    train_ddp.py and train_fsdp.py: all in one 2-process launch, nothing written."""
    configs = {"falcon": write_more_configs(tmp_path, ["falcon"])["falcon"]}
    for family, config in {**DROPPING_ATTENTION, "xglm": {**MORE_FAMILIES["xglm"], "layerdrop": 0.5}}.items():
        configs[family] = tmp_path / f"{family}.json"
        configs[family].write_text(json.dumps({"model_type": family, **config}))
    cp, dropped = ["--cp_size", "2"], ["skips layers at random in training", "set the layer drop to 0"]
    runs = [
        ("falcon", "train_cp.py", cp, ["--cp_size: falcon", "compute attention themselves", "without --cp_size"]),
        ("falcon", "train_cp.py", [*cp, "--cp_impl", "ulysses"], ["--cp_size: falcon", "compute attention themselves"]),
        ("gpt2", "train_cp.py", cp, ["--cp_size", "drops attention weights in training (p 0.1)", "attn_pdrop"]),
        ("llama", "train_cp.py", [*cp, "--cp_impl", "ulysses"], ["drops attention weights in training (p 0.1)"]),
        ("gpt2", "train_hybrid.py", cp, ["--cp_size", "drops attention weights in training (p 0.1)"]),
        ("xglm", "train_ddp.py", [], ["train_ddp.py: the model", *dropped]),
        ("xglm", "train_fsdp.py", [], ["train_fsdp.py: the model", *dropped]),
    ]
    cases = []
    for i, (family, script, flags, _) in enumerate(runs):
        args = [*FLAGS, *flags, "--model_config", str(configs[family]), "--data_cache_dir", data_cache]
        cases.append([str(SCRIPTS / script), [*args, "--output_dir", str(tmp_path / f"run{i}")]])
    results = run_in_turn(cases, 2, tmp_path / "in_turn")
    for i, (result, (family, script, _, needles)) in enumerate(zip(results, runs, strict=True)):
        assert_one_line(result, *needles)
        assert not (tmp_path / f"run{i}").exists(), f"{family} ({script}) wrote its output"
