#!/usr/bin/env python
"""Evaluate a saved model (OUTPUT_DIR/model) on its validation split, on any number of processes.

Each process scores its share of the split (every N-th sample), the padding that evens out the
last batch is cut off, and the sums are added over the processes, so every sample is counted
exactly once and the result is the same for 1, 2 or 3 processes.

    python scripts/evaluate.py --model_dir runs/ddp/model --generate 5
    accelerate launch --config_file accelerate_configs/cpu_multi.yaml scripts/evaluate.py --model_dir runs/ddp/model

The data set is the one the model was trained on (model/data.json); naming another one
(--dataset, --dataset_name or --train_file) replaces it whole, and the other data flags override it.
Prints one JSON object (eval_loss, exact_match or perplexity, num_samples) and writes it to
--output_file if given.

A model of your own (a Task subclass of common.task.Task trained it) is rebuilt and scored by its
Task, which then needs two more methods; the Task is made with no arguments:

    build_model(self, config) -> nn.Module   the model, from model/config.json (what Task.config() wrote);
                                             model.safetensors is then loaded into it, strictly
    validation_data(self) -> dataset         the validation split, rows as the training script's data
                                             section gives them (len() and [i]; the same on every process)

    python scripts/evaluate.py --model_dir runs/regression/model --task regression.py:RegressionTask

The training run records where its Task lives (model/task.json), so --task may be left out where
that file still exists. The figures are the Task's own (Task.eval_metrics) and num_samples; the
data flags and --generate are for the built-in data and models, and are refused.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts run as files: make `common` importable

import torch

from common.builtin_flags import SOURCE_DEFAULTS, add_data_args, check_data_args, check_max_eval_samples
from common.causal_lm import logits_of
from common.cli import SOURCE_KEYS, HelpFormatter
from common.data import first_samples, load_data
from common.errors import UsageError
from common.evaluation import evaluate
from common.exported import load_exported, task_spec_for
from common.faults import line_on_sigterm
from common.launch import make_accelerator, record_peers, run_main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model_dir", required=True, help="a saved model: OUTPUT_DIR/model of a training run")
    p.add_argument(
        "--task",
        metavar="FILE.py:Class",
        help="a model of your own: the file (or module:Class, importable from the current directory) and class of "
        "the Task that trained it; it rebuilds the model (Task.build_model(config)) and gives the data "
        "(Task.validation_data()) (default: the Task recorded in --model_dir's task.json, for a model that is "
        "neither the built-in GPT nor a 🤗 model)",
    )
    p.add_argument("--output_file", help="also write the JSON result here")
    p.add_argument("--batch_size", type=int, default=250, help="evaluation batch per process")
    p.add_argument(
        "--generate",
        type=int,
        default=0,
        metavar="N",
        help="print N greedy samples (addition answers, text continuations)",
    )
    p.add_argument("--cpu", action="store_true", help="run on CPU even where CUDA exists")
    p.add_argument("--collective_timeout", type=float, default=300, help="seconds a collective may wait for a peer")
    add_data_args(p, defaults_from_model=True)
    return p


def chosen_data(flags: dict) -> tuple[str, object]:
    """The data set the data flags select, in load_data's order: a hub name, else a train file, else a built-in."""
    key = next((k for k in ("dataset_name", "train_file") if flags.get(k) is not None), "dataset")
    return key, flags.get(key)


def model_data_defaults(source: dict, given: argparse.Namespace) -> dict:
    """The data flags' defaults: the data the model was trained on (its data.json), unless the command
    line names another data set, which replaces the model's whole (its hub name and files no longer apply)."""
    if chosen_data(vars(given))[1] is not None and chosen_data(vars(given)) != chosen_data(source):
        source = {}
    return {**SOURCE_DEFAULTS, **{k: v for k, v in source.items() if k in SOURCE_KEYS and v is not None}}


@torch.no_grad()
def greedy(model, prompt: torch.Tensor, max_new_tokens: int, stop: int | None = None) -> list[int]:
    ids = prompt[None]
    context = getattr(model.config, "block_size", None) or getattr(model.config, "max_position_embeddings", 1024)
    for _ in range(max_new_tokens):
        next_id = logits_of(model(ids[:, -context:]))[0, -1].argmax()
        ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
        if stop is not None and next_id.item() == stop:
            break
    return ids[0, len(prompt) :].tolist()


def show_samples(model, validation, task: str, n: int, device, tokenizer=None) -> None:
    """Greedy answers (addition) or continuations (text); ids are bytes unless the model has a tokenizer."""

    def decode(ids) -> str:
        return tokenizer.decode(ids) if tokenizer is not None else bytes(ids).decode(errors="replace")

    stop = ord("\n") if tokenizer is None else (tokenizer.convert_tokens_to_ids("\n") or None)
    for row in (validation[i] for i in range(min(n, len(validation)))):
        ids = row["input_ids"].to(device)
        if task == "addition":
            answer_start = int((row["labels"] != -100).nonzero()[0])
            prompt = decode(ids[:answer_start].tolist())
            got = decode(greedy(model, ids[:answer_start], 12, stop=stop)).strip()
            a, b = prompt[:-1].split("+")
            want = str(int(a) + int(b))
            print(
                f"{prompt}{got:<6} i.e. {int(a)} + {int(b)} = {got[::-1]:<5}"
                f" {'ok' if got[::-1] == want else 'WRONG, want ' + want}"
            )
        else:
            prompt = ids[:32]
            out = decode(greedy(model, prompt, 96))
            print(f"--- prompt: {decode(prompt.tolist())!r}\n    continuation: {out!r}")


def own_validation_data(task, named_by: str, args):
    """The validation split of a model of your own: its Task's validation_data(), on every process."""
    given = [f"--{key}" for key in SOURCE_KEYS if getattr(args, key) is not None]
    name = type(task).__name__
    if given:
        raise UsageError(
            f"{given[0]}: a model of your own is scored on its Task's validation_data() ({name}), not on the data "
            f"flags: drop {' '.join(given)}"
        )
    if args.generate:
        raise UsageError(f"--generate prints samples of the built-in data sets; a model of your own ({name}) has none")
    if not callable(getattr(task, "validation_data", None)):
        raise UsageError(
            f"{named_by}: {name} has no validation_data(): add `def validation_data(self): return <dataset>`, the "
            "validation split as your training script's data section makes it (rows with len() and [i]) "
            '(docs/your-model.md, "Evaluating your model with evaluate.py")'
        )
    try:
        validation = task.validation_data()
        n = len(validation)
    except Exception as e:
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        raise UsageError(
            f"{named_by}: {name}.validation_data() failed ({why}): it must return rows with len()"
        ) from None
    if n == 0:
        raise UsageError(f"{named_by}: {name}.validation_data() returned no rows: there is nothing to evaluate")
    return validation


def main():
    parser = build_parser()
    known, _ = parser.parse_known_args()
    own_task = task_spec_for(known.model_dir, known.task)  # a model of your own: (its Task, who named it)
    model, task, source = load_exported(known.model_dir, own_task)
    if own_task is None:  # the data flags default to the data the model was trained on
        parser.set_defaults(**model_data_defaults(source, known))
    args = parser.parse_args()
    if args.batch_size < 1 or args.generate < 0:
        raise UsageError("--batch_size must be at least 1 and --generate not negative")
    if own_task is None:
        check_data_args(args)
    else:  # your own model: your own data, from its Task
        check_max_eval_samples(args)
        validation = first_samples(own_validation_data(task, own_task[1], args), args.max_eval_samples)
    args.report_to, args.output_dir = "none", None

    accelerator = make_accelerator(args)  # Accelerate: process group, device
    record_peers(accelerator)  # who every rank is: the line below names a peer found gone
    line_on_sigterm()  # a peer that dies makes the launcher end this one: one line, not silence
    if own_task is None:
        data = load_data(args, accelerator, task.tokens_per_sample, getattr(task, "tokenizer", None))
        task.tokens_per_sample, task.data_task = data.seq_len, data.task  # what the model is scored on
        validation = data.validation
    model = accelerator.prepare_model(model, evaluation_mode=True)  # Accelerate: to device, no DDP wrapper
    # each process scores every N-th sample; the sums are added over the processes: each sample counts once
    result = evaluate(accelerator, model, task, validation, args.batch_size)
    if accelerator.is_main_process:
        print(json.dumps(result))
        if args.output_file:
            Path(args.output_file).parent.mkdir(parents=True, exist_ok=True)
            Path(args.output_file).write_text(json.dumps(result) + "\n")
        if args.generate:
            tokenizer = getattr(task, "tokenizer", None)
            show_samples(model.eval(), validation, data.task, args.generate, accelerator.device, tokenizer)
    accelerator.wait_for_everyone()
    accelerator.end_training()  # Accelerate: destroys the process group


if __name__ == "__main__":
    run_main(main)
