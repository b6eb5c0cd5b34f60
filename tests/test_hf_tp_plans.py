"""train_tp.py's plans read from each 🤗 model's own config (config.base_model_tp_plan, through the style
table of its `# TP:` section), against the one-process train_ddp.py run of the same model within 1e-5 per
step over 4 steps (fp32, 4-digit addition: answers of unequal target counts):
- every family of the zoo on 2 processes with --sequence_parallel --loss_parallel, matched or refused, is
  tests/test_hf_zoo.py's "tp 2" column (Llama's names, Qwen3's and Gemma 3's per-head norms, Mistral's
  window, Phi-3's fused qkv/gate_up, GPT-NeoX's parallel residual, gpt-oss's embedding-only plan, the MoE
  families' experts refused); here, one of each kind of plan without them;
- KV heads fewer than --tp_size (2 KV heads on 4 ranks) replicated as Megatron does, with Qwen3's k_norm;
  the start banner and the summary give the copies' extra bytes per rank;
- the refusals, one `error:` line each and no training: a style the table does not map, a bare parameter
  in the plan, a family with no plan (GPT-2), a --tp_size that fits neither the KV heads nor a multiple of
  them, one that does not divide the MLP width, KV copies beside data parallel (train_hybrid.py).
One launch per process count runs the cases in turn (tests/zoo_driver.py)."""

import json

import pytest
from zoo_configs import FAMILIES, MOE_FAMILIES

from conftest import SCRIPTS, TINY, run_in_turn, train_losses

pytestmark = pytest.mark.xdist_group("hf_tp_plans")  # the launches share the references: one worker runs them

STEPS = range(1, 5)
FLAGS = ["--max_steps", "4", "--addition_digits", "4", "--eval_every", "0", "--collective_timeout", "120"]
PLAIN = ["--batch_size", "16"]
TP = [*PLAIN, "--sequence_parallel", "--loss_parallel"]
DENSE = ("llama", "qwen3", "mistral", "gemma3_text", "phi3", "gpt_neox", "gpt_oss")
# without --sequence_parallel --loss_parallel too, one of each kind of plan: column/row-wise, per-head norms,
# gathered fused projections, GPT-NeoX's fused per-head qkv (Mistral's and Gemma 3's plans are Llama's and Qwen3's)
PLAIN_TOO = ("llama", "qwen3", "phi3", "gpt_neox")
REFUSED_MOE = tuple(f for f in MOE_FAMILIES if f != "gpt_oss")  # their plans cut the experts' 3-D weights
# 2 KV heads for 8 query heads: on 4 ranks each KV head is replicated on 2
KV2 = {f"{f}_kv2": {**FAMILIES[f], "num_key_value_heads": 2} for f in ("llama", "qwen3")}
LLAMA_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise_mystery",  # no such style in transformers, nor in our table
    "layers.*.mlp.down_proj": "rowwise",
}
CONFIGS = {
    **{f: {"model_type": f, **FAMILIES[f]} for f in DENSE + REFUSED_MOE},
    **{name: {"model_type": name.removesuffix("_kv2"), **values} for name, values in KV2.items()},
    "llama_unknown_style": {"model_type": "llama", **FAMILIES["llama"], "base_model_tp_plan": LLAMA_PLAN},
    # a parameter, not a module, in the plan (as granite_swa's attention sinks)
    "llama_param_in_plan": {"model_type": "llama", **FAMILIES["llama"]}
    | {
        "base_model_tp_plan": {
            **LLAMA_PLAN,
            "layers.*.mlp.up_proj": "colwise",
            "layers.*.self_attn.q_proj.weight": "colwise",
        }
    },
    "gpt2": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 8, "n_positions": 64},  # no TP plan
    "llama_kv3": {"model_type": "llama", **FAMILIES["llama"], "hidden_size": 96, "num_attention_heads": 12}
    | {"num_key_value_heads": 3},
    "llama_mlp126": {"model_type": "llama", **FAMILIES["llama"], "intermediate_size": 126},  # 126 = 2 x 63
    "llama_kv1": {"model_type": "llama", **FAMILIES["llama"], "num_key_value_heads": 1},  # for train_hybrid.py
}
HYBRID = ["--batch_size", "8", "--dp_shard", "2", "--tp_size", "2"]
# 2 KV heads x 8 rows (head_dim) x 64 inputs, k and v, 4 layers: each rank keeps 8 rows where 1/4 would be 4,
# fp32: 4 x 64 x 4 bytes x 2 x 4 = 8192 bytes
KV2_EXTRA_BYTES = 8192


def case(script, name, flags, configs, folder, data_cache, run_name=None):
    args = [*TINY, *FLAGS, *flags, "--model_config", str(configs[name]), "--data_cache_dir", data_cache]
    return [str(SCRIPTS / script), [*args, "--output_dir", str(folder / (run_name or name))]]


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tp_plan_configs")
    paths = {}
    for name, values in CONFIGS.items():
        paths[name] = folder / f"{name}.json"
        paths[name].write_text(json.dumps(values))
    return paths


@pytest.fixture(scope="module")
def references(configs, data_cache, tmp_path_factory):
    """The one-process train_ddp.py run (global batch 16) of every model that trains under TP, in one launch."""
    folder, names = tmp_path_factory.mktemp("tp_plan_refs"), [*PLAIN_TOO, *KV2]
    results = run_in_turn([case("train_ddp.py", n, PLAIN, configs, folder, data_cache) for n in names], 1, folder)
    for name, result in zip(names, results, strict=True):
        assert result["returncode"] == 0, f"one-process train_ddp.py {name}:\n{result['stderr']}"
    return {name: train_losses(folder / name) for name in names}


def errors_of(result: dict) -> list[str]:
    return [line for line in result["stderr"].splitlines() if line.startswith("error:")]


def assert_matches(name, result, references, folder, run_name=None) -> float:
    run_name = run_name or name
    assert result["returncode"] == 0, f"{run_name} under TP:\n{result['stderr']}"
    ref, got = references[name], train_losses(folder / run_name)
    assert all(s in got for s in STEPS), f"{run_name}: steps missing: {sorted(got)}"
    diff = max(abs(ref[s] - got[s]) for s in STEPS)
    print(f"PARITY {run_name} max|diff| {diff:.2e}")
    assert diff <= 1e-5, f"{run_name}: exit 0 with other losses (max |diff| {diff:.3g})"
    return diff


def assert_refused(name, result, folder, *words) -> None:
    """Exit 2, one `error:` line holding `words`, and nothing trained."""
    errors = errors_of(result)
    assert result["returncode"] == 2 and len(errors) == 1, f"{name}: exit {result['returncode']}\n{result['stderr']}"
    for w in words:
        assert w in errors[0], f"{name}: {w!r} not in {errors[0]}"
    assert not (folder / name / "metrics.jsonl").exists(), f"{name}: a refused run trained"


def summary_of(folder) -> dict:
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in records if r["type"] == "summary")


def test_every_family_on_2_ranks_matches_or_is_refused(configs, references, data_cache, tmp_path):
    """2 ranks without sequence and loss parallel (with them: the zoo's "tp 2" column): one family of each kind
    of plan matches one process, Megatron's all-reduces counted; a plan with a style we do not map or a bare
    parameter, and a family with no plan stop before training with one line."""
    refused = ["llama_unknown_style", "llama_param_in_plan", "gpt2"]
    cases = [case("train_tp.py", n, TP, configs, tmp_path, data_cache) for n in refused]
    cases += [case("train_tp.py", n, PLAIN, configs, tmp_path, data_cache, f"{n}_plain") for n in PLAIN_TOO]
    results = run_in_turn(cases, 2, tmp_path)
    by_name = dict(zip([*refused, *(f"{n}_plain" for n in PLAIN_TOO)], results, strict=True))
    for name in PLAIN_TOO:
        assert_matches(name, by_name[f"{name}_plain"], references, tmp_path, f"{name}_plain")
        assert summary_of(tmp_path / f"{name}_plain")["megatron_allreduces_per_step"] == 16, name
    assert_refused(
        "llama_unknown_style",
        by_name["llama_unknown_style"],
        tmp_path,
        "model.layers.*.mlp.up_proj on style 'colwise_mystery'",
        "does not map to a torch ParallelStyle",
    )
    assert_refused(
        "llama_param_in_plan",
        by_name["llama_param_in_plan"],
        tmp_path,
        "the parameter model.layers.*.self_attn.q_proj.weight",
    )
    assert_refused("gpt2", by_name["gpt2"], tmp_path, "gpt2 has no TP plan in transformers", "train_fsdp.py")


def test_kv_heads_fewer_than_tp_are_replicated(configs, references, data_cache, tmp_path):
    """2 KV heads on 4 ranks (Llama; Qwen3, whose k_norm then sees the copies): each rank keeps its query
    heads' KV head, the copies' gradients summed: the one-process losses, and the copies' extra bytes in the
    banner and the summary. 3 KV heads on 4 ranks, an MLP width of 126, and KV copies beside data parallel
    (train_hybrid.py dp 2 x tp 2, 1 KV head): refused."""
    refused = ["llama_kv3", "llama_mlp126"]
    names = [*KV2, *refused, "llama_kv1"]
    cases = [case("train_tp.py", n, TP, configs, tmp_path, data_cache) for n in names[:-1]]
    cases.append(case("train_hybrid.py", "llama_kv1", HYBRID, configs, tmp_path, data_cache))
    results = run_in_turn(cases, 4, tmp_path)
    by_name = dict(zip(names, results, strict=True))
    for name in KV2:
        assert_matches(name, by_name[name], references, tmp_path)
        assert summary_of(tmp_path / name)["kv_copies_extra_weight_bytes_per_rank"] == KV2_EXTRA_BYTES, name
    banner = "KV heads: 2 for 4 ranks, so each is replicated on 2 ranks (Megatron)"
    for name in KV2:
        stdout = by_name[name]["stdout"]
        assert banner in stdout and f"{KV2_EXTRA_BYTES:,} bytes of weights per rank" in stdout, stdout
    assert_refused(
        "llama_kv3", by_name["llama_kv3"], tmp_path, "--tp_size 4 neither divides the model's 3 key/value heads"
    )
    assert_refused(
        "llama_mlp126",
        by_name["llama_mlp126"],
        tmp_path,
        "--tp_size 4 does not divide the model's 126 layers.*.mlp.gate_proj outputs (out_features): use --tp_size 2",
    )
    assert_refused(
        "llama_kv1", by_name["llama_kv1"], tmp_path, "made by train_tp.py alone", "--tp_size 2: the model's 1"
    )
