"""🤗 transformers causal LMs through every training script (issue 21): built from tiny configs with
the byte vocabulary, the scripts whose code changes with the degree on 4 CPU processes (every script on 2:
tests/test_hf_zoo.py) match the one-process train_ddp.py run within 1e-5 (fp32), for Llama and Qwen2; the
exported folder loads with `AutoModelForCausalLM.from_pretrained` and gives the run's eval loss; a pretrained
folder with a tokenizer trains on that tokenizer's ids, and train_fsdp.py, which reads only each rank's slices of its
files, matches train_ddp.py, which loads it whole. Everything offline: the test writes every config and
tokenizer it uses."""

import argparse
import json
import sys
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from conftest import SCRIPTS, TINY, assert_same_losses, evals, launch, run_in_turn, summary, train_losses

sys.path.insert(0, str(SCRIPTS))
from common.builtin_flags import add_data_args
from common.data import load_data

# the six 4-process runs share one launch (xdist group hf_scripts_4); the other tests spread over both workers
# (each runs the one-process references it needs once)

BASE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,  # GQA: 4 KV heads for 8 query heads, which TP 2 and 4 split
    "max_position_embeddings": 64,
}
FAMILIES = {"llama": {"model_type": "llama", **BASE}, "qwen2": {"model_type": "qwen2", **BASE}}
# 4-digit addition: 16-token rows, which 2 and 4 TP ranks can split for sequence parallel, with answers of
# 2 to 6 targets (unequal counts)
FLAGS = ["--max_steps", "4", "--addition_digits", "4", "--eval_batch_size", "500"]
STEPS = list(range(1, 5))
GLOBAL_BATCH = 16
# (script, processes, flags, families): each keeps the global batch of 16 samples. Every script on 2 processes, for
# every family, is tests/test_hf_zoo.py's table; here the cases whose code changes with the degree, on 4 processes:
# FSDP's shards of Qwen2 (q/k/v biases) built on meta, TP over the GQA split 4 ways (with the biases), 4 pipeline
# stages under GPipe, the hybrids, dp 2 x cp 2. (DDP's code does not change with the degree or the family.)
LLAMA, QWEN2 = ("llama",), ("qwen2",)
PP = ["--n_microbatches", "4"]
CASES = [
    ("train_fsdp.py", 4, ["--batch_size", "4"], QWEN2),
    ("train_tp.py", 4, ["--batch_size", "16", "--sequence_parallel", "--loss_parallel"], QWEN2),
    ("train_pp.py", 4, ["--batch_size", "16", *PP, "--schedule", "gpipe"], LLAMA),
    # pipeline stages of a TP group under sequence parallel: each rank's slice of the sequence crosses the stages
    (
        "train_hybrid.py",
        4,
        ["--batch_size", "16", "--pp_size", "2", "--tp_size", "2", "--dp_shard", "1", *PP] + ["--sequence_parallel"],
        LLAMA,
    ),
    ("train_hybrid.py", 4, ["--batch_size", "8", "--dp_shard", "2", "--tp_size", "2", "--sequence_parallel"], QWEN2),
    # context parallel through transformers' AttentionInterface: dp 2 x cp 2, grouped KV heads, rotary positions
    ("train_cp.py", 4, ["--batch_size", "8", "--cp_size", "2"], LLAMA),
]
RUNS = [(family, script, nproc, flags) for script, nproc, flags, families in CASES for family in families]


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf_configs")
    paths = {}
    for name, config in FAMILIES.items():
        paths[name] = folder / f"{name}.json"
        paths[name].write_text(json.dumps(config))
    return paths


def run(script, out, data_cache, config, *flags, nproc=1):
    return launch(
        script,
        [
            *TINY,
            *FLAGS,
            "--model_config",
            str(config),
            *flags,
            "--data_cache_dir",
            data_cache,
            "--output_dir",
            str(out),
        ],
        nproc=nproc,
    )


@pytest.fixture(scope="module")
def references(configs, data_cache, tmp_path_factory):
    """The one-process train_ddp.py run of each family (global batch 16), run once."""
    cache = {}

    def reference(family):
        if family not in cache:
            out = tmp_path_factory.mktemp(f"hf_ref_{family}") / "run"
            run("train_ddp.py", out, data_cache, configs[family], "--batch_size", str(GLOBAL_BATCH))
            cache[family] = out
        return cache[family]

    return reference


@pytest.fixture(scope="module")
def four_process_runs(configs, data_cache, tmp_path_factory) -> list[tuple]:
    """The six 4-process runs in one launch, in turn (run_in_turn): [(output directory, stdout), ...]."""
    folder = tmp_path_factory.mktemp("hf_four")
    outs = [folder / f"run{i}" for i in range(len(RUNS))]
    cases = [
        [str(SCRIPTS / script), [*TINY, *FLAGS, "--model_config", str(configs[family]), *flags]]
        for family, script, _, flags in RUNS
    ]
    for case, out in zip(cases, outs, strict=True):
        case[1] += ["--data_cache_dir", data_cache, "--output_dir", str(out)]
    assert {nproc for _, _, nproc, _ in RUNS} == {4}
    results = run_in_turn(cases, 4, folder)
    for run_case, result in zip(RUNS, results, strict=True):
        assert result["returncode"] == 0, f"{run_case}: exit {result['returncode']}\n{result['stderr']}"
    return [(out, result["stdout"]) for out, result in zip(outs, results, strict=True)]


@pytest.mark.xdist_group("hf_scripts_4")
@pytest.mark.parametrize("index", range(len(RUNS)), ids=[f"{s.removesuffix('.py')}-{n}-{f}" for f, s, n, _ in RUNS])
def test_matches_the_one_process_run(index, four_process_runs, references):
    (family, script, nproc, _), (out, stdout) = RUNS[index], four_process_runs[index]
    assert f"model {family} (🤗 transformers" in stdout
    ref = references(family)
    a, b = train_losses(ref), train_losses(out)
    print(f"PARITY {family} {script} {nproc} max|diff| {max(abs(a[s] - b[s]) for s in STEPS if s in a and s in b):.2e}")
    assert_same_losses(a, b, STEPS, tol=1e-5)
    final, ref_final = evals(out)[-1], evals(ref)[-1]
    assert final["num_samples"] == ref_final["num_samples"] == 1000
    assert abs(final["eval_loss"] - ref_final["eval_loss"]) < 1e-5
    assert summary(out)["world_size"] == nproc


def test_local_sgd_every_step_is_ddp(configs, data_cache, tmp_path, references):
    """Local SGD fusing every step, with plain SGD and no clipping, is data parallelism: it matches DDP."""
    sgd = ["--optimizer", "sgd", "--max_grad_norm", "0", "--learning_rate", "0.5"]
    ddp, local = tmp_path / "ddp", tmp_path / "local"
    run("train_ddp.py", ddp, data_cache, configs["llama"], "--batch_size", "8", *sgd, nproc=2)
    run(
        "train_localsgd.py",
        local,
        data_cache,
        configs["llama"],
        "--batch_size",
        "8",
        "--sync_every",
        "1",
        *sgd,
        nproc=2,
    )
    assert_same_losses(train_losses(ddp), train_losses(local), STEPS, tol=1e-5)


def test_export_loads_with_from_pretrained_and_evaluates(configs, references, data_cache, tmp_path):
    """OUT/model is a 🤗 folder: from_pretrained gives the run's final eval loss, and evaluate.py
    (on 2 processes) gives it too."""
    from transformers import AutoModelForCausalLM

    run_dir = references("llama")
    model = AutoModelForCausalLM.from_pretrained(run_dir / "model")
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.vocab_size == 256
    # the eval loss of the validation split, recomputed here by hand with the loaded model
    parser = argparse.ArgumentParser()
    add_data_args(parser)
    args = parser.parse_args(["--data_cache_dir", data_cache])
    vars(args).update(json.loads((run_dir / "model" / "data.json").read_text()))  # the data the model learned
    validation = load_data(args, SimpleNamespace(local_main_process_first=nullcontext), 64).validation
    loss_sum = n = 0.0
    with torch.no_grad():
        for start in range(0, len(validation), 250):
            rows = [validation[i] for i in range(start, min(start + 250, len(validation)))]
            ids = torch.stack([r["input_ids"] for r in rows])
            labels = torch.stack([r["labels"] for r in rows])
            logits = model(ids).logits[:, :-1]
            targets = labels[:, 1:]
            loss_sum += torch.nn.functional.cross_entropy(
                logits.transpose(1, 2), targets, ignore_index=-100, reduction="sum"
            ).item()
            n += (targets != -100).sum().item()
    assert abs(loss_sum / n - evals(run_dir)[-1]["eval_loss"]) < 1e-5
    out = tmp_path / "eval.json"
    launch("evaluate.py", ["--model_dir", str(run_dir / "model"), "--output_file", str(out)], nproc=2)
    result = json.loads(out.read_text())
    assert result["num_samples"] == 1000 and abs(result["eval_loss"] - evals(run_dir)[-1]["eval_loss"]) < 1e-5


def test_pretrained_folder_trains_on_its_tokenizer(configs, data_cache, tmp_path):
    """A local pretrained folder (saved here: a tiny Llama and a byte-level BPE trained on a few strings)
    trains on its tokenizer's ids, and its export carries the tokenizer. train_fsdp.py builds it on the
    meta device and each rank reads only its shards from the safetensors file (the untied head from the
    tied embedding's tensor), and so does train_tp.py: the losses are those of train_ddp.py, which loads
    the model whole."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([f"{a:04d}+{b:04d}={str(a + b)[::-1]}\n" for a in range(60) for b in range(9)], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    folder = tmp_path / "pretrained"
    torch.manual_seed(0)
    # tied embeddings, untied by the run: the head of each rank's shards is read from the embedding's tensor
    config = LlamaConfig(**{k: v for k, v in BASE.items()}, vocab_size=len(tokenizer), tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    flags = [*TINY, *FLAGS, "--model_name_or_path", str(folder), "--untie_embeddings", "--data_cache_dir", data_cache]
    out, one = tmp_path / "run", tmp_path / "one"
    result = launch("train_fsdp.py", [*flags, "--batch_size", "8", "--output_dir", str(out)], nproc=2)
    assert f"{len(tokenizer)} ids" in result.stdout  # the banner names the tokenizer's vocabulary
    assert "each rank made only its shards of the weights" in result.stdout  # built on meta, read in slices
    launch("train_ddp.py", [*flags, "--batch_size", "16", "--output_dir", str(one)], nproc=1)  # loaded whole
    assert_same_losses(train_losses(one), train_losses(out), STEPS, 1e-5)
    tp = tmp_path / "tp"  # the TP shards, read in slices: rows of q/k/v, columns of o_proj, the vocabulary's rows
    result = launch("train_tp.py", [*flags, "--batch_size", "16", "--output_dir", str(tp)], nproc=2)
    assert "each rank made only its shards of the weights" in result.stdout
    assert_same_losses(train_losses(one), train_losses(tp), STEPS, 1e-5)
    assert AutoTokenizer.from_pretrained(out / "model").vocab_size == tokenizer.vocab_size


def test_a_loss_the_scripts_do_not_compute_is_refused(data_cache, tmp_path):
    """An MoE config asking for its auxiliary balance loss (output_router_logits) would have it silently
    dropped by the scripts' loss, under every strategy: one line, exit 2, nothing written."""
    config = tmp_path / "mixtral.json"
    mixtral = {**BASE, "num_local_experts": 4, "num_experts_per_tok": 2, "output_router_logits": True}
    config.write_text(json.dumps({"model_type": "mixtral", **mixtral}))
    out = tmp_path / "run"
    flags = [*TINY, *FLAGS, "--model_config", str(config), "--data_cache_dir", data_cache, "--output_dir", str(out)]
    result = launch("train_ddp.py", flags, nproc=1, check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "auxiliary balance loss" in result.stderr and "output_router_logits false" in result.stderr
    assert not out.exists() or not any(out.iterdir())
