"""Every run proves its cut before step 1 (scripts/common/cut_check.py, issue 42): the lesson's own step on a
probe against the uncut model. Cases no named gate refuses, and cases whose gate the test turns off
(tests/cut_check_driver.py), must end in one `error:` line naming the strategy and the first module where
the cut and the uncut model part; a cut that is the model says so in its start lines.

- BLOOM under the ring and Ulysses: its ALiBi attention never calls the attention CP installs, so each
  rank attends within its own tokens (the run trained 3e-4 off, its start line saying 0 MiB of ring traffic);
- Mistral's 8-token sliding window handed to neither (as before the window gate): 1e-4 to 5e-3 off;
- a tied embedding and output layer cut by TP with both tie gates off: two weights, initialised apart;
- Mistral under the ring with its window: checked, and --skip_cut_check is said;
- a model too large for one rank: checked as a shrunken copy of its architecture (common/shrunk.py), or,
  a model of one's own, skipped with the reason."""

import json
import re
import sys

import pytest
import torch

from conftest import REPO, SCRIPTS, TINY, launch_cmd, run_cmd, run_in_turn

sys.path.insert(0, str(SCRIPTS))

pytestmark = pytest.mark.xdist_group("cut_check")

FLAGS = [*TINY, "--max_steps", "2", "--addition_digits", "4", "--batch_size", "16"]
BLOOM = {"model_type": "bloom", "hidden_size": 64, "n_layer": 2, "n_head": 8}
DENSE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8}
MISTRAL = {"model_type": "mistral", **DENSE, "num_key_value_heads": 4, "sliding_window": 8}
LLAMA = {"model_type": "llama", **DENSE, "num_key_value_heads": 4}


def configs(folder) -> dict:
    paths = {}
    for name, config in {"bloom": BLOOM, "mistral": MISTRAL, "llama": LLAMA}.items():
        paths[name] = folder / f"{name}.json"
        paths[name].write_text(json.dumps({**config, "max_position_embeddings": 64}))
    return paths


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def assert_refused(result, strategy: str, module: str) -> None:
    errors = error_lines(result["stderr"])
    assert result["returncode"] != 0 and len(errors) == 1, f"exit {result['returncode']}:\n{result['stderr'][-3000:]}"
    assert errors[0].startswith(f"error: {strategy}: the cut model does not compute the model"), errors[0]
    assert f"first part at {module}" in errors[0], errors[0]


def test_unnamed_cuts_are_refused_and_a_true_cut_is_checked(tmp_path, data_cache):
    paths = configs(tmp_path)
    common = [*FLAGS, "--data_cache_dir", data_cache, "--cp_size", "2"]
    cases = [
        [str(SCRIPTS / "train_cp.py"), [*common, "--model_config", str(paths["bloom"])]],
        [str(SCRIPTS / "train_cp.py"), [*common, "--model_config", str(paths["bloom"]), "--cp_impl", "ulysses"]],
        [str(SCRIPTS / "train_cp.py"), [*common, "--model_config", str(paths["mistral"])]],
        [str(SCRIPTS / "train_ddp.py"), [*FLAGS, "--data_cache_dir", data_cache, "--skip_cut_check"]],
        # every model 'too large for one rank': checked on a shrunken copy, the same script up to its check
        [str(SCRIPTS / "train_tp.py"), [*FLAGS, "--data_cache_dir", data_cache, "--model_config", str(paths["llama"])]],
        [str(SCRIPTS / "train_pp.py"), [*FLAGS, "--data_cache_dir", data_cache]],
        [str(SCRIPTS / "train_cp.py"), [*common, "--model_config", str(paths["bloom"])]],
        # the last: its gate stays on in the process. No rank holds the model: the contract runs on the copy
        [str(REPO / "tests" / "cut_check_driver.py"), ["mean", str(SCRIPTS / "train_pp.py"), *FLAGS]],
    ]
    cases[-1][1] += ["--data_cache_dir", data_cache]
    for i, case in enumerate(cases):
        case[1] += ["--output_dir", str(tmp_path / f"run{i}")]
        case += [{"CUT_CHECK_MAX_BYTES": "0"}] if 4 <= i < 7 else []
    ring, ulysses, window_kept, skipped, *shrunken, mean = run_in_turn(cases, 2, tmp_path / "in_turn")
    assert_refused(ring, "train_cp.py", "transformer.h.0.self_attention")  # ALiBi: CP's attention is not called
    assert_refused(ulysses, "train_cp.py", "transformer.h.0.self_attention")
    assert window_kept["returncode"] == 0, window_kept["stderr"][-3000:]
    checked = [line for line in window_kept["stdout"].splitlines() if "cut checked: train_cp.py's step" in line]
    assert checked, window_kept["stdout"][-3000:]
    gaps = [float(re.match(r"[-+.e\d]+\d", x).group()) for x in checked[0].split("|Δ| ")[1:]]
    assert max(gaps) <= 1e-5, checked[0]
    assert "cut check: skipped (--skip_cut_check)" in skipped["stdout"], skipped["stdout"][-3000:]
    tp, pp, bloom = shrunken
    for i, run, strategy, shape in (
        (4, tp, "train_tp.py", "2 layers x 64 wide"),
        (5, pp, "train_pp.py", "2 layers x 32 wide"),
    ):
        assert run["returncode"] == 0, run["stderr"][-3000:]
        line = next((x for x in run["stdout"].splitlines() if "cut checked: " in x), run["stdout"][-3000:])
        assert f"cut checked: {strategy}'s step" in line and f"on a shrunken copy, {shape}" in line, line
        assert "train" in (tmp_path / f"run{i}" / "metrics.jsonl").read_text(), "the run trains on after the check"
        assert not (tmp_path / f"run{i}" / ".shrunken_cut_check").exists()
    assert_refused(bloom, "train_cp.py", "transformer.h.0.self_attention")  # refused on the copy as on the whole
    assert "(on a shrunken copy, 2 layers x 64 wide: the whole model is too large" in error_lines(bloom["stderr"])[0]
    assert mean["returncode"] == 2 and error_lines(mean["stderr"]), mean["stderr"][-3000:]
    assert error_lines(mean["stderr"])[0].startswith("error: the loss of a micro-batch is not a sum"), mean["stderr"]


@pytest.mark.parametrize(
    "gate, script, flags, strategy, module",
    [
        ("window", "train_cp.py", ["--cp_size", "2"], "train_cp.py", "model.layers.0.self_attn"),
        ("ties", "train_tp.py", [], "train_tp.py", "model.embed_tokens"),
    ],
    ids=["window-gate-off", "tie-gates-off"],
)
def test_a_gate_turned_off_is_caught_by_the_cut_check(gate, script, flags, strategy, module, tmp_path, data_cache):
    paths = configs(tmp_path)
    config = paths["mistral" if gate == "window" else "llama"]
    args = [gate, str(SCRIPTS / script), *FLAGS, *flags, "--model_config", str(config)]
    args += ["--data_cache_dir", data_cache, "--output_dir", str(tmp_path / "run")]
    result = run_cmd(launch_cmd("../tests/cut_check_driver.py", args, nproc=2))
    assert_refused({"returncode": result.returncode, "stderr": result.stderr}, strategy, module)
    assert (
        not (tmp_path / "run" / "metrics.jsonl").exists()
        or "train" not in (tmp_path / "run" / "metrics.jsonl").read_text()
    )


def test_every_family_shrinks_into_a_model_that_builds(monkeypatch):
    """The shrunken copy of each family the zoo knows, from transformers' own full-size config: it builds,
    keeps its heads and experts, and is small (WORLD_SIZE 2: 4 layers at most)."""
    from more_zoo_configs import MORE_FAMILIES
    from transformers import AutoConfig, AutoModelForCausalLM
    from zoo_configs import FAMILIES

    from common.shrunk import LAYERS, shrunk_hf_config

    monkeypatch.setenv("WORLD_SIZE", "2")
    for family in sorted({f.removesuffix("_window16") for f in [*FAMILIES, *MORE_FAMILIES]}):
        big = AutoConfig.for_model(family).to_dict()
        small = shrunk_hf_config(big)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**small))
        n_params = sum(p.numel() for p in model.parameters())
        layers = next(small[k] for k in LAYERS if k in small)
        assert layers <= 4 and n_params < 3e8, (family, layers, n_params)
        for kept in ("num_attention_heads", "num_key_value_heads", "num_local_experts", "num_experts", "vocab_size"):
            assert small.get(kept) == big.get(kept), (family, kept)


def test_a_model_of_ones_own_too_large_is_skipped_with_the_reason(monkeypatch):
    from common.cut_check import uncut_copy

    monkeypatch.setenv("CUT_CHECK_MAX_BYTES", "0")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)  # 2 processes (one cuts nothing)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    line = uncut_copy(torch.nn.Linear(4, 4), task=object())
    too_large = "cut check: skipped (the whole model (0.0 GiB) is too large to copy onto one rank; a model of one's own"
    assert line.startswith(too_large), line
