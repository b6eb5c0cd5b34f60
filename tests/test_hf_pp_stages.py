"""Pipeline stages of any 🤗 family (issue 30, item 3): train_pp.py cuts a model at its decoder layers in
the order of its own pipeline plan (config.base_model_pp_plan), each stage running the family's own
forward with the parts it does not hold passed through, after checking on the whole model that the
stages chained give its logits.

1F1B with 4 micro-batches on 2 processes, every family of the zoo: tests/test_hf_zoo.py's "pp 2" column.
Here, four families from tiny configs (tests/zoo_configs.py, random init, 4 layers, 16-token rows) with
interleaved 1F1B (2 stages per rank, one layer each) match the one-process train_ddp.py run within 1e-5
per step over 4 steps. Mistral's window (8 tokens) is shorter than the rows, and Gemma 3 mixes sliding and
full layers: a sliding layer on every stage of rank 0 and a full one on every stage of rank 1, so a stage
that gave a layer the wrong mask would show in the losses. Two launches in all (the cases of one launch
run in turn on one process group: tests/zoo_driver.py); the refusals are checked in-process."""

import json
import sys

import pytest
import torch
from zoo_configs import FAMILIES, write_configs

from conftest import SCRIPTS, TINY, run_in_turn, train_losses

sys.path.insert(0, str(SCRIPTS))

pytestmark = pytest.mark.xdist_group("hf_pp_stages")  # the pipeline launch needs the reference launch's runs

STEPS = range(1, 5)
FLAGS = ["--max_steps", "4", "--addition_digits", "4", "--eval_every", "0", "--collective_timeout", "120"]
INTERLEAVED = [
    "--batch_size",
    "16",
    "--n_microbatches",
    "4",
    "--schedule",
    "interleaved_1f1b",
    "--stages_per_rank",
    "2",
]
INTERLEAVED_FAMILIES = ("mistral", "gemma3_text", "gpt_neox", "deepseek_v3")
assert set(INTERLEAVED_FAMILIES) <= set(FAMILIES)
# (family, schedule) -> words the one `error:` line must hold; empty: every family here trains exactly
EXPECTED: dict = {}


def case(script: str, flags: list, config, out, data_cache) -> list:
    args = [*TINY, *FLAGS, *flags, "--model_config", str(config), "--data_cache_dir", data_cache]
    return [str(SCRIPTS / script), [*args, "--output_dir", str(out)]]


def test_every_family_matches_one_process(data_cache, tmp_path):
    (tmp_path / "configs").mkdir()
    configs = write_configs(tmp_path / "configs")
    ref_cases = [
        case("train_ddp.py", ["--batch_size", "16"], configs[f], tmp_path / "ref" / f, data_cache)
        for f in INTERLEAVED_FAMILIES
    ]
    (tmp_path / "ref").mkdir()
    for family, result in zip(INTERLEAVED_FAMILIES, run_in_turn(ref_cases, 1, tmp_path / "ref"), strict=True):
        assert result["returncode"] == 0, f"one-process train_ddp.py {family}:\n{result['stderr']}"
    runs = [(f, "interleaved_1f1b", INTERLEAVED) for f in INTERLEAVED_FAMILIES]
    (tmp_path / "pp").mkdir()
    pp_cases = [
        case("train_pp.py", flags, configs[f], tmp_path / "pp" / f"{f}-{s}", data_cache) for f, s, flags in runs
    ]
    wrong = []
    for (family, schedule, _), result in zip(runs, run_in_turn(pp_cases, 2, tmp_path / "pp"), strict=True):
        errors = [line for line in result["stderr"].splitlines() if line.startswith("error:")]
        expected = EXPECTED.get((family, schedule))
        if result["returncode"] == 0:
            ref, got = train_losses(tmp_path / "ref" / family), train_losses(tmp_path / "pp" / f"{family}-{schedule}")
            diff = max(abs(ref[s] - got[s]) for s in STEPS) if all(s in got for s in STEPS) else float("inf")
            print(f"PARITY {family} {schedule} max|diff| {diff:.1e}")
            if not diff <= 1e-5:
                wrong.append(
                    f"{family} {schedule}: exit 0 with other losses (max |diff| {diff:.3g}): a silent wrong run"
                )
            elif expected:
                wrong.append(f"{family} {schedule}: trains and matches ({diff:.1e}), but EXPECTED says refused")
        elif result["returncode"] != 2 or len(errors) != 1 or not expected or expected not in errors[0]:
            wrong.append(
                f"{family} {schedule}: exit {result['returncode']}, expected {expected or 'to match'}:\n"
                f"{result['stderr'][-1500:]}"
            )
    assert not wrong, "\n".join(wrong)


SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4}


def tiny_model(tmp_path, model_type: str, **config):
    """The model train_pp.py would build from a config of `model_type` (the byte vocabulary, untied)."""
    from types import SimpleNamespace

    from common.hf import load_hf_model

    path = tmp_path / f"{model_type}.json"
    path.write_text(json.dumps({"model_type": model_type, "max_position_embeddings": 32, **config}))
    torch.manual_seed(0)
    args = SimpleNamespace(model_name_or_path=None, model_config=str(path), block_size=None)
    return load_hf_model(args, 16, "addition", tokenizer=None)[0]


def test_a_family_whose_forward_changes_the_hidden_states_is_refused(tmp_path):
    """Granite multiplies whatever it is given as inputs_embeds by its embedding_multiplier, so a later stage
    would scale the hidden states again: the check on the whole model finds it, one line, before training;
    with a multiplier of 1 the same family passes."""
    from common.errors import UsageError
    from common.pp_checks import check_stages_compute
    from train_pp import stage_modules

    halves = [range(0, 2), range(2, 4)]
    check_stages_compute(tiny_model(tmp_path, "granite", **SMALL), halves, stage_modules)
    with pytest.raises(UsageError, match="granite's 2 pipeline stages, chained, do not give the whole model's logits"):
        check_stages_compute(tiny_model(tmp_path, "granite", **SMALL, embedding_multiplier=12.0), halves, stage_modules)


def test_a_family_without_a_pipeline_plan_is_refused(tmp_path):
    from common.errors import UsageError
    from common.hf_pp import hf_pipeline_parts

    model = tiny_model(tmp_path, "gpt2", n_embd=32, n_layer=2, n_head=4)
    with pytest.raises(UsageError, match="gpt2 has no pipeline plan"):
        hf_pipeline_parts(model)


def test_a_stage_puts_the_model_back(tmp_path):
    """During a stage's forward the parts it does not run are pass-throughs; after it, the model is as the
    split left it (placeholders and None: what the TP plan and the checkpoints read)."""
    from common.hf_pp import HFPipelineStage, hf_pipeline_parts
    from train_pp import stage_modules

    model = tiny_model(tmp_path, "gpt_neox", **SMALL, rotary_pct=0.5)
    parts = hf_pipeline_parts(model)
    assert parts == (("embed_in", "emb_dropout"), "gpt_neox.layers", ("final_layer_norm",), "lm_head")
    layers = model.gpt_neox.layers
    layers[0] = layers[1] = torch.nn.Identity()  # rank 1 of 2: layers 2 and 3
    (stage,) = stage_modules(model, [(range(2, 4), False, True)])
    before = dict(model.named_modules())
    assert isinstance(stage, HFPipelineStage) and model.gpt_neox.embed_in is None
    logits = stage(torch.randn(2, 16, 32))
    assert logits.shape == (2, 16, 256)
    assert dict(model.named_modules()) == before
    assert sorted(n for n, _ in stage.named_parameters()) == sorted(
        n.replace("gpt_neox.layers.", "layers.").replace("gpt_neox.", "ends.").replace("lm_head.", "head.")
        for n, _ in model.named_parameters()
    )
