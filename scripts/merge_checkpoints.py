#!/usr/bin/env python
"""Model fusion: average N saved models into one ("train apart, then average").

    python scripts/merge_checkpoints.py runs/a/model runs/b/model --out runs/fused/model
    python scripts/merge_checkpoints.py runs/a/model runs/b/model --weights 0.75 0.25 --out runs/fused/model
    python scripts/evaluate.py --model_dir runs/fused/model

Every input is a `model/` directory written by a training script (model.safetensors +
config.json): the built-in GPT's, or a 🤗 transformers folder. The models must be one model (the
same parameter names and shapes, the same config); the result is sum_i w_i * theta_i (uniform
weights by default, normalised to sum to 1), saved in fp32 the way the first model was saved (its
Task's export: the same config and the first model's data.json; a 🤗 folder for 🤗 models).
Averaging helps when the models are close (the replicas of a Local SGD run, or fine-tunes of one
base); two models trained apart from different initialisations sit in different basins, and their
average is usually worse than either.
"""

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts run as files: copy common/ beside this file

import torch

from common.checkpoint import record_task
from common.cli import HelpFormatter
from common.errors import UsageError
from common.exported import load_exported, task_spec_for
from common.launch import run_main


def missing_model_hint(model_dir: Path) -> str:
    """What to do about a directory without model.safetensors."""
    if model_dir.parent.name == "rank_models" and re.fullmatch(r"rank_\d+", model_dir.name):
        return (
            "train_localsgd.py writes OUTPUT_DIR/rank_models/rank_N only when run with --save_rank_models"
            " (or pass OUTPUT_DIR/model of a training run)"
        )
    return "pass OUTPUT_DIR/model of a training run"


# what a 🤗 config records about the file rather than the model (the folder it was loaded from, versions)
BOOKKEEPING = {"transformers_version", "dtype", "torch_dtype", "architectures", "use_cache"}


def first_difference(a: dict, b: dict) -> str | None:
    """The first name whose value differs between two {name: value} dicts ("absent" where missing)."""
    return next(
        (
            f"{name} {a.get(name, 'absent')} vs {b.get(name, 'absent')}"
            for name in [*a, *(n for n in b if n not in a)]
            if a.get(name) != b.get(name)
        ),
        None,
    )


def model_difference(model_a, task_a, model_b, task_b) -> str | None:
    """How model b differs from model a: the first parameter name or shape, else the first config entry."""
    shapes = [{k: list(t.shape) for k, t in m.state_dict().items()} for m in (model_a, model_b)]
    configs = [
        {k: v for k, v in t.config().items() if k not in BOOKKEEPING and not k.startswith("_")}
        for t in (task_a, task_b)
    ]
    return first_difference(*shapes) or first_difference(*configs)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("model_dirs", nargs="+", help="saved model directories (OUTPUT_DIR/model)")
    p.add_argument("--out", required=True, help="where the merged model directory is written")
    p.add_argument("--weights", type=float, nargs="+", help="one weight per model (default: uniform)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out directory")
    p.add_argument(
        "--task",
        metavar="FILE.py:Class",
        help="for models of your own: the Task that trained them, with build_model(config) (default: the one each "
        "model's task.json records; docs/your-model.md)",
    )
    args = p.parse_args()

    weights = args.weights or [1.0] * len(args.model_dirs)
    if len(weights) != len(args.model_dirs):
        raise UsageError(f"--weights has {len(weights)} values for {len(args.model_dirs)} models: give one per model")
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise UsageError("--weights must be non-negative and not all zero")
    out = Path(args.out)
    if out.exists() and not args.overwrite:
        raise UsageError(f"--out {out} already exists: choose another directory or pass --overwrite")
    if any(out.resolve() == Path(d).resolve() for d in args.model_dirs):
        raise UsageError(f"--out {out} is one of the inputs: write the merge elsewhere")
    for d in args.model_dirs:
        if not any((Path(d) / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json")):
            raise UsageError(f"{d}: no model.safetensors here: {missing_model_hint(Path(d))}")

    models = [load_exported(d, task_spec_for(d, args.task)) for d in args.model_dirs]  # (model, task, data) each
    first_model, first_task, first_data = models[0]
    for d, (model, task, _) in zip(args.model_dirs[1:], models[1:]):
        difference = model_difference(first_model, first_task, model, task)
        if difference:
            raise UsageError(
                f"{d}: another model than {args.model_dirs[0]} (first difference: {difference}): only models of one "
                "config can be averaged"
            )

    total = sum(weights)
    with torch.no_grad():
        merged = {
            name: torch.zeros_like(t, dtype=torch.float32) if t.is_floating_point() else t.clone()
            for name, t in first_model.state_dict().items()
        }  # integer buffers (none in the built-in model) are the first model's
        for (model, _, _), w in zip(models, weights):
            for name, t in model.state_dict().items():
                if t.is_floating_point():
                    merged[name] += (w / total) * t.float()
    first_task.export(merged, out, first_data)  # the first model's format: its config, its data.json
    record_task(first_task, out)  # a Task of your own: evaluate.py finds it again
    print(json.dumps({"merged": args.model_dirs, "weights": [w / total for w in weights], "out": str(out)}))


if __name__ == "__main__":
    run_main(main)
