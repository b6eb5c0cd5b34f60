"""Every weight of a 🤗 model built on the meta device is made (issue 42): materialize_hf runs transformers'
own init module by module, and a module's init may write its children's tensors (Qwen3-Next's MoE block
initialises its router's weight; the router owns it). A tensor no init writes would keep whatever memory
torch.empty handed out: here torch.empty fills NaN, and no NaN or inf may be left after materialize, for every
family the zoo knows and the ones it does not train (tests/more_zoo_configs.py). The weights must be exactly
what transformers' initialize_weights gives from the same seed, and equal from build to build; sharded by FSDP
over 2 processes, each rank's shards must be the whole model's parts."""

import argparse
import json
import sys

import pytest
import torch
from more_zoo_configs import MORE_FAMILIES, write_more_configs
from zoo_configs import FAMILIES, write_configs

from conftest import REPO, SCRIPTS, free_port, run_cmd

sys.path.insert(0, str(SCRIPTS))
from common.hf import load_hf_model

ALL_FAMILIES = [*FAMILIES, *MORE_FAMILIES]


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("init_configs")
    return {**write_configs(folder), **write_more_configs(folder)}


def made_on_meta(config, monkeypatch, junk: float) -> dict:
    """The scripts' way (load_hf_model(on_meta=True), to_empty, task.materialize) with every torch.empty and
    empty_like of floats filled with `junk`: a tensor left unmade keeps it. -> the state dict"""
    empty, empty_like = torch.empty, torch.empty_like

    def filled(t):
        return t.fill_(junk) if t.is_floating_point() and t.device.type != "meta" else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: filled(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: filled(empty_like(*a, **k)))
    try:
        args = argparse.Namespace(model_config=str(config), model_name_or_path=None)
        model, task = load_hf_model(args, 16, "text", tokenizer=None, on_meta=True)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        task.materialize(model)
    finally:
        monkeypatch.setattr(torch, "empty", empty)
        monkeypatch.setattr(torch, "empty_like", empty_like)
    return model, {k: v.clone() for k, v in model.state_dict().items()}


def initialize_weights(model) -> dict:
    """What transformers' own initialize_weights gives the same model from seed 0, on the CPU."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    for t in (*reference.modules(), *reference.parameters(), *reference.buffers()):
        t.__dict__.pop("_is_hf_initialized", None)
    torch.manual_seed(0)
    reference.initialize_weights()
    return reference.state_dict()


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_every_weight_is_made_as_transformers_makes_it(configs, family, monkeypatch):
    model, made = made_on_meta(configs[family], monkeypatch, float("nan"))
    unmade = [k for k, v in made.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    assert not unmade, f"{family}: left as torch.empty made them: {unmade}"
    _, again = made_on_meta(configs[family], monkeypatch, 1e30)
    assert all(torch.equal(made[k], again[k]) for k in made), f"{family}: two builds differ"
    expected = initialize_weights(model)
    assert made.keys() == expected.keys()
    differ = [k for k in made if not torch.equal(made[k], expected[k])]
    assert not differ, f"{family}: not what transformers' initialize_weights gives: {differ}"


def test_fsdp_shards_are_the_whole_models_parts(configs, tmp_path):
    """Qwen3-Next's router, which its MoE block initialises, sharded over 2 ranks like every other weight."""
    result = tmp_path / "gaps.json"
    port = str(free_port())
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port]
    driver = [str(REPO / "tests" / "hf_init_driver.py"), str(configs["qwen3_next"]), str(result)]
    done = run_cmd([*torchrun, *driver], timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    gaps = json.loads(result.read_text())
    assert any(".mlp.gate.weight" in k for k in gaps)
    assert max(gaps.values()) == 0, {k: v for k, v in gaps.items() if v}


def test_a_parents_init_is_seen_writing_a_child_even_where_torch_skips_meta():
    """torch.nn.init's trunc_normal_ and orthogonal_ return at once on meta tensors (no in-place op): the dry
    run over meta stand-ins must still see them write, and the RNG must be as it was after it."""
    from torch import nn
    from transformers import initialization as init

    from common.hf import writes_of_each_init

    block = nn.Module()
    block.router, block.proj = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)

    def init_fn(module, custom):
        if module is block:  # the block initialises its children's weights, as Qwen3-Next's MoE block its router's
            init.trunc_normal_(module.router.weight, std=0.02)
            torch.nn.init.orthogonal_(module.proj.weight)

    order = [(block.router, init_fn), (block.proj, init_fn), (block, init_fn)]
    slots_of = {id(m.weight): [(m, "weight")] for m in (block.router, block.proj)}
    rng = torch.get_rng_state()
    writes = writes_of_each_init(order, slots_of, custom=False)
    assert torch.equal(rng, torch.get_rng_state())
    assert writes == [set(), set(), {id(block.router.weight), id(block.proj.weight)}]
    assert not block.router.weight.is_meta  # the model's own tensors are back in their slots


# where each family keeps its decoder layers (the units every strategy cuts at), as load_hf_model finds them
UNITS = {
    "llama4_text": "model.layers",  # its base model is held as `model` but named `language_model`
    "opt": "model.decoder.layers",  # a floor down
    "mamba": "backbone.layers",
    "gpt2": "transformer.h",
}


@pytest.mark.parametrize("family", list(UNITS))
def test_the_layers_are_found_where_each_family_keeps_them(configs, family):
    """And the base model is the module that holds them: TP's and PP's plans are paths from it. Mamba, which
    has no attention heads, is described without them."""
    args = argparse.Namespace(model_config=str(configs[family]), model_name_or_path=None)
    model, task = load_hf_model(args, 16, "text", tokenizer=None, on_meta=True)
    assert task.units_path == UNITS[family]
    assert model.get_submodule(task.units_path) in list(model.base_model.modules())
    assert model.base_model is not model
    assert ("no attention heads" in task.describe(model)) == (family == "mamba")
