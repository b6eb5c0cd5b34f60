"""Every run proves its cut before step 1 (scripts/common/cut_check.py, issue 42): the lesson's own step on a
probe against the uncut model. Cases no named gate refuses, and cases whose gate the test turns off
(tests/cut_check_driver.py), must end in one `error:` line naming the strategy and the first module where
the cut and the uncut model part; a cut that is the model says so in its start lines.

- BLOOM under the ring and Ulysses: its ALiBi attention never calls the attention CP installs, so each
  rank attends within its own tokens (the run trained 3e-4 off, its start line saying 0 MiB of ring traffic);
- Mistral's 8-token sliding window handed to neither (as before the window gate): 1e-4 to 5e-3 off;
- a tied embedding and output layer cut by TP with both tie gates off: two weights, initialised apart;
- Mistral under the ring with its window: checked, and --skip_cut_check is said."""

import json
import re

import pytest

from conftest import SCRIPTS, TINY, launch_cmd, run_cmd, run_in_turn

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
    ]
    for i, case in enumerate(cases):
        case[1] += ["--output_dir", str(tmp_path / f"run{i}")]
    ring, ulysses, window_kept, skipped = run_in_turn(cases, 2, tmp_path / "in_turn")
    assert_refused(ring, "train_cp.py", "transformer.h.0.self_attention")  # ALiBi: CP's attention is not called
    assert_refused(ulysses, "train_cp.py", "transformer.h.0.self_attention")
    assert window_kept["returncode"] == 0, window_kept["stderr"][-3000:]
    checked = [line for line in window_kept["stdout"].splitlines() if "cut checked: train_cp.py's step" in line]
    assert checked, window_kept["stdout"][-3000:]
    gaps = [float(re.match(r"[-+.e\d]+\d", x).group()) for x in checked[0].split("|Δ| ")[1:]]
    assert max(gaps) <= 1e-5, checked[0]
    assert "cut check: skipped (--skip_cut_check)" in skipped["stdout"], skipped["stdout"][-3000:]


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
