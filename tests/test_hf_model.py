"""common/hf.py: 🤗 transformers causal LMs behind the model contract, offline, on tiny configs, in one
process: building, loading, the tokenizer, export, the errors a user can fix."""

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import SCRIPTS

sys.path.insert(0, str(SCRIPTS))
from common.errors import UsageError
from common.hf import (
    check_untied,
    hf_context_length,
    load_exported_hf,
    load_hf_model,
    load_tokenizer,
)

SEQ = 16
# tiny configs of each family the TP plan and pipeline stage claim; GQA (2 KV heads for 4 query heads)
BASE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
CONFIGS = {
    "llama": {"model_type": "llama", **BASE},
    "qwen2": {"model_type": "qwen2", **BASE},  # q/k/v biases
    "qwen3": {"model_type": "qwen3", **BASE, "head_dim": 16},  # per-head q/k RMSNorm
    "mistral": {"model_type": "mistral", **BASE, "sliding_window": 8},  # a window shorter than the sequence
}
# (sequence_parallel, loss_parallel) per family on 2 ranks: all four where the plan differs (Llama; Qwen3's per-head
# q/k norms), one each for the others (q/k/v biases; a sliding-window mask); TP_STAGES also as pipeline stages under SP
ALL = [(False, False), (False, True), (True, False), (True, True)]
TP_CASES = {"llama": ALL, "qwen3": ALL, "qwen2": [(True, True)], "mistral": [(True, False)]}
TP_STAGES = ("llama", "mistral")


def write_configs(folder: Path) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, values in CONFIGS.items():
        paths[name] = folder / f"{name}.json"
        paths[name].write_text(json.dumps(values))
    return paths


def flags(model_config=None, model_name_or_path=None, **extra):
    return argparse.Namespace(model_config=model_config, model_name_or_path=model_name_or_path, **extra)


def build(config_path, seed: int = 0):
    torch.manual_seed(seed)  # what set_seed does for the model's init
    return load_hf_model(flags(str(config_path)), SEQ, "text")


def batch(seed: int = 1):
    """Token ids and labels: the first 5 positions are not targets (an addition prompt's way)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (2, SEQ), generator=g)
    labels = ids.clone()
    labels[:, :5] = -100
    return ids, labels


def mean_loss(task, model, ids, labels) -> torch.Tensor:
    loss_sum, n = task.loss(model(*task.inputs({"input_ids": ids})), labels)
    return loss_sum / n


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    return write_configs(tmp_path_factory.mktemp("configs"))


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    """A byte-level BPE trained here on a few strings (no download), with an end-of-text token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([f"{a:03d}+{b:03d}={str(a + b)[::-1]}\n" for a in range(50) for b in range(9)], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


# ---------------------------------------------------------------- building


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_build_is_deterministic_fp32_sdpa_bytes(configs, family):
    (a, task), (b, _) = build(configs[family]), build(configs[family])
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    other, _ = build(configs[family], seed=1)
    assert not torch.equal(other.lm_head.weight, a.lm_head.weight)  # the init really follows the seed
    assert a.dtype == torch.float32 and a.config._attn_implementation == "sdpa" and not a.config.use_cache
    assert a.config.vocab_size == 256 and not a.config.tie_word_embeddings
    assert a.lm_head.weight is not a.model.embed_tokens.weight
    assert task.units(a) is a.model.layers and len(task.units(a)) == 2
    assert task.describe(a) == (
        f"model {family} (🤗 transformers, from config {family}.json): "
        f"{sum(p.numel() for p in a.parameters()) / 1e6:.2f}M parameters, 2 layers x 64 wide, "
        "4 heads / 2 KV heads, vocabulary 256 (bytes)"
    )


def test_a_model_type_name_builds_a_small_model():
    torch.manual_seed(0)
    model, task = load_hf_model(flags("qwen2"), 32, "addition")
    c = model.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_key_value_heads, c.max_position_embeddings) == (4, 128, 2, 128)
    longer, _ = load_hf_model(flags("qwen2", block_size=256), 256, "text")
    assert longer.config.max_position_embeddings == 256  # the run's context (--block_size)
    assert "from config qwen2 (small defaults)" in task.describe(model)


def test_loss_then_export_loads_with_from_pretrained(configs, tmp_path):
    from transformers import AutoModelForCausalLM

    model, task = build(configs["qwen2"])
    ids, labels = batch()
    loss = mean_loss(task, model, ids, labels)
    loss.backward()
    assert model.model.layers[0].mlp.up_proj.weight.grad is not None
    n = task.count_targets({"labels": labels})
    assert n == 2 * (SEQ - 5)  # targets are labels[:, 1:] that are not -100

    out = tmp_path / "run" / "model"
    out.parent.mkdir()
    task.export(model.state_dict(), out, {"dataset": "addition", "addition_digits": 3})
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "data.json",
        "generation_config.json",
        "model.safetensors",
    ]
    assert json.loads((out / "data.json").read_text())["addition_digits"] == 3
    assert not list(out.parent.glob(".tmp_*"))  # written beside, renamed into place
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.dtype == torch.float32
    with torch.no_grad():
        assert torch.equal(mean_loss(task, loaded, ids, labels), loss.detach())
    # and back in as --model_name_or_path: the same weights, described as pretrained
    again, task2 = load_hf_model(flags(model_name_or_path=str(out)), SEQ, "text")
    assert torch.equal(again.model.layers[1].self_attn.q_proj.bias, model.model.layers[1].self_attn.q_proj.bias)
    assert f"pretrained {out}" in task2.describe(again) and not again.config.use_cache
    assert task2.config()["model_type"] == "qwen2"
    # what evaluate.py loads (common/exported.py: load_exported): the same model, its context from the config
    evaluated, task3 = load_exported_hf(out)
    with torch.no_grad():
        assert torch.equal(mean_loss(task3, evaluated, ids, labels), loss.detach())
    assert task3.tokens_per_sample == 64 and task3.tokenizer is None
    n = sum(p.numel() for p in model.parameters())
    assert task.flops_per_item(n) == 6 * n + 12 * 2 * 64 * SEQ  # 6N + attention scores (12·L·width·T)


def test_bad_flags_are_one_line_usage_errors(configs, tmp_path):
    def error(args) -> str:
        with pytest.raises(UsageError) as e:
            load_hf_model(args, SEQ, "text")
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "got both" in error(flags(str(configs["llama"]), str(tmp_path)))
    assert "got neither" in error(flags())
    assert "--model_name_or_path org/no-such-model: no such local folder, and not in the local 🤗 cache" in error(
        flags(model_name_or_path="org/no-such-model")
    )
    assert "the folder has no config.json" in error(flags(model_name_or_path=str(tmp_path)))
    (tmp_path / "bad.json").write_text('{"hidden_size": 8}')
    assert 'has no "model_type"' in error(flags(str(tmp_path / "bad.json")))
    (tmp_path / "t5.json").write_text('{"model_type": "t5"}')
    assert "'t5' is not a decoder-only causal LM" in error(flags(str(tmp_path / "t5.json")))
    (tmp_path / "gpt2.json").write_text('{"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2}')
    # the decoder layers are found from the family, wherever its base model keeps them
    assert load_hf_model(flags(str(tmp_path / "gpt2.json")), 16, "addition")[1].units_path == "transformer.h"
    with pytest.raises(UsageError, match=r"--block_size 128 is longer than the model's max_position_embeddings \(64\)"):
        hf_context_length(flags(str(configs["llama"]), block_size=128))
    assert hf_context_length(flags(str(configs["llama"]))) == 64  # the config's, as --block_size is not given
    assert hf_context_length(flags("llama")) == 128 and hf_context_length(flags("llama", block_size=32)) == 32


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_comes_with_the_model_folder(configs, tiny_tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = tmp_path / "pretrained"
    config = LlamaConfig(**{**BASE, "vocab_size": len(tiny_tokenizer), "tie_word_embeddings": True})
    LlamaForCausalLM(config).save_pretrained(folder)
    assert load_tokenizer(flags(model_name_or_path=str(folder))) is None  # weights only: the data stays bytes
    tiny_tokenizer.save_pretrained(folder)

    tokenizer = load_tokenizer(flags(model_name_or_path=str(folder)))
    assert tokenizer is not None and len(tokenizer) == len(tiny_tokenizer) > 256
    assert tokenizer("012+345=")["input_ids"] == tiny_tokenizer("012+345=")["input_ids"]
    assert tokenizer.eos_token_id is not None
    assert load_tokenizer(flags(str(configs["llama"]))) is None  # models from a config read bytes

    model, task = load_hf_model(flags(model_name_or_path=str(folder)), SEQ, "text")
    assert len(task.tokenizer) == len(tokenizer)
    n = len(tokenizer)
    assert f"vocabulary {n} (tokenizer {type(tokenizer).__name__}, {n} ids)" in task.describe(model)
    assert "tied embeddings" in task.describe(model)
    out = tmp_path / "model"
    task.export(model.state_dict(), out, {})
    assert AutoTokenizer.from_pretrained(out)("9+9=")["input_ids"] == tokenizer("9+9=")["input_ids"]
    loaded, ids = AutoModelForCausalLM.from_pretrained(out), batch()[0]
    with torch.no_grad():  # tied embeddings survive the export (lm_head is embed_tokens again)
        assert torch.equal(loaded(ids).logits, model(ids).logits) and loaded.config.tie_word_embeddings

    # a tokenizer with more ids than the model's embedding has rows
    small = tmp_path / "small"
    LlamaForCausalLM(LlamaConfig(**{**BASE, "vocab_size": 256})).save_pretrained(small)
    tiny_tokenizer.save_pretrained(small)
    with pytest.raises(
        UsageError, match=f"the tokenizer .* has {len(tokenizer)} ids but the model's embedding only 256"
    ):
        load_hf_model(flags(model_name_or_path=str(small)), SEQ, "text")


def test_a_hub_name_is_read_from_the_local_cache_only(tiny_tokenizer, tmp_path, monkeypatch):
    import huggingface_hub.constants
    from transformers import LlamaConfig, LlamaForCausalLM

    repo = tmp_path / "hub" / "models--org--tiny"  # the 🤗 cache's layout, as `hf download org/tiny` leaves it
    snapshot = repo / "snapshots" / "0123abcd"
    LlamaForCausalLM(LlamaConfig(**{**BASE, "vocab_size": len(tiny_tokenizer)})).save_pretrained(snapshot)
    tiny_tokenizer.save_pretrained(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))

    model, task = load_hf_model(flags(model_name_or_path="org/tiny"), SEQ, "text")
    assert task.tokenizer is not None and "pretrained org/tiny" in task.describe(model)
    # its config only: random init, on the byte vocabulary, no tokenizer
    torch.manual_seed(0)
    fresh, task2 = load_hf_model(flags("org/tiny"), SEQ, "text")
    assert fresh.config.vocab_size == 256 and task2.tokenizer is None
    assert "from the config of org/tiny" in task2.describe(fresh) and "vocabulary 256 (bytes)" in task2.describe(fresh)
    with pytest.raises(UsageError, match="--model_config org/other: no such local folder, and not in the local"):
        load_hf_model(flags("org/other"), SEQ, "text")


# ---------------------------------------------------------------- tied embeddings


def test_tied_embeddings_are_refused_where_a_strategy_would_cut_them_apart(tmp_path):
    """TP shards the head and the embedding apart, PP puts them on different stages: a tied pair is refused
    in one line (check_untied), and --untie_embeddings starts the head as a copy of the embedding. (The
    TP plans and the pipeline stages themselves: tests/test_hf_tp_plans.py, tests/test_hf_pp_stages.py.)"""
    from transformers import LlamaConfig, LlamaForCausalLM

    tied = tmp_path / "tied"
    LlamaForCausalLM(LlamaConfig(**{**BASE, "vocab_size": 256, "tie_word_embeddings": True})).save_pretrained(tied)
    tied_model, _ = load_hf_model(flags(model_name_or_path=str(tied)), SEQ, "text")
    with pytest.raises(UsageError, match="ties lm_head to embed_tokens.*--untie_embeddings"):
        check_untied(tied_model, "tensor parallelism")
    untied, _ = load_hf_model(flags(model_name_or_path=str(tied), untie_embeddings=True), SEQ, "text")
    assert torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    check_untied(untied, "tensor parallelism")
