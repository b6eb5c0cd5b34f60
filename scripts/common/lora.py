"""LoRA adapters with PEFT (--lora_r): the base model frozen, a low-rank update B·A beside each targeted
linear layer trained (docs/lora.md). Imported only by a run that asks for LoRA.

PEFT's `inject_adapter_in_model` replaces each targeted `nn.Linear` in place by a `peft` LoRA layer (the
original as its `base_layer`, the adapters as `lora_A.default` and `lora_B.default`): the model keeps its
class and its module tree, so a strategy's units, pipeline split and plans find what they know, one level
deeper (`get_peft_model`'s wrapper would put `base_model.model.` before every name). What the run writes
is what `PeftModel.save_pretrained` writes: `adapter_model.safetensors` and `adapter_config.json`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch.nn as nn

from .errors import UsageError

ADAPTER = "default"  # PEFT's name for the one adapter a run trains


def check_lora_args(args) -> None:
    """The LoRA flags, before any process group exists."""
    if args.lora_r is None:
        given = [f"--{f}" for f in ("lora_target_modules", "merge_lora") if getattr(args, f)]
        if given:
            raise UsageError(f"{given[0]} needs --lora_r: give the adapters' rank, e.g. --lora_r 8")
    elif args.lora_r < 1:
        raise UsageError(f"--lora_r must be at least 1 (got {args.lora_r}); leave it out to train every weight")
    elif args.lora_alpha <= 0 or not 0 <= args.lora_dropout < 1:
        raise UsageError(
            f"--lora_alpha must be positive (got {args.lora_alpha}) and --lora_dropout in [0, 1) "
            f"(got {args.lora_dropout})"
        )


def _linear_names(model: nn.Module) -> list[str]:
    """The last name part of every nn.Linear except the output head, in order, once each."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = [n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head]
    return list(dict.fromkeys(names))


def default_targets(model: nn.Module) -> list[str]:
    """The attention and MLP projections: every linear layer whose name ends in `proj` (the built-in GPT's
    and most 🤗 families': q/k/v/o, gate/up/down). A family named otherwise is refused, its names listed."""
    found = [n for n in _linear_names(model) if n.endswith("proj")]
    if not found:
        raise UsageError(
            f"--lora_r: this model has no linear layer named *proj; name the layers to adapt with "
            f"--lora_target_modules (its linear layers: {', '.join(_linear_names(model)) or 'none'})"
        )
    return found


def apply_lora(model: nn.Module, task, args) -> tuple[nn.Module, object]:
    """Freeze the model and inject the adapters, the same on every rank (seed set before: A is drawn from
    it, B starts at zero, so step 0 computes the base model). Records on `task.lora` what the export needs."""
    from peft import LoraConfig, inject_adapter_in_model

    if any(p.is_meta for p in model.parameters()):
        raise UsageError("--lora_r: the model was built on the meta device; LoRA needs its weights (internal)")
    if args.lora_target_modules:
        targets = [t.strip() for t in args.lora_target_modules.split(",") if t.strip()]
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        heads = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if head is not None and m is head}
        if heads & set(targets):  # the head stays whole under TP's loss parallel and in Muon's AdamW part
            raise UsageError(
                f"--lora_target_modules {args.lora_target_modules}: the output head takes no adapter here "
                f"({', '.join(sorted(heads & set(targets)))}); name the hidden layers only"
            )
        known = _linear_names(model)
        unknown = [t for t in targets if t not in known]
        if unknown or not targets:
            raise UsageError(
                f"--lora_target_modules {args.lora_target_modules}: {', '.join(unknown) or 'no name'} names no "
                f"linear layer of this model (its linear layers: {', '.join(known) or 'none'})"
            )
    else:
        targets = default_targets(model)
    config = LoraConfig(
        r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout, target_modules=targets, bias="none"
    )
    inject_adapter_in_model(config, model)
    for name, p in model.named_parameters():  # only the adapters train (PEFT did this; say it, then check it)
        p.requires_grad_(".lora_A." in name or ".lora_B." in name)
    base = getattr(args, "model_name_or_path", None)
    # the model itself: a strategy cuts it in place (its start line counts what this rank then holds)
    task.lora = {"config": config, "base": base, "merge": args.merge_lora, "model": model}
    task.lora.update(export=export_lora, line=lora_line)  # the trial export and the start line call them
    return model, task


def lora_line(model: nn.Module, optimizer: str = "adamw") -> str:
    """The start line: what trains, of what, and the bytes this rank holds for it (its shards, its stage)."""

    def local(p):  # this rank's part of a parameter a strategy cut (a DTensor), else the whole
        return p.to_local() if hasattr(p, "to_local") else p

    n_all = sum(p.numel() for p in model.parameters())  # the whole model's counts, before a cut
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_layers = sum(1 for n, _ in model.named_modules() if n.endswith(f".lora_A.{ADAPTER}"))
    weights = sum(local(p).numel() * p.element_size() for p in model.parameters())
    trained = sum(local(p).numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    states = {"adamw": 2, "sgd": 0, "muon": 1}.get(optimizer, 2)  # Muon: the adapters are matrices, 1 momentum

    def mib(n):
        return f"{n / 2**20:.2f} MiB"

    return (
        f"LoRA: {n_train:,} of {n_all:,} parameters train ({100 * n_train / max(n_all, 1):.2f}%), adapters on "
        f"{n_layers} linear layers, the base frozen; per rank: weights {mib(weights)}, gradients {mib(trained)}, "
        f"optimizer state {mib(states * trained)}"
    )


def base_state_dict(full_sd: dict) -> dict:
    """The frozen base's tensors under the model's own names (`x.base_layer.weight` -> `x.weight`)."""
    return {k.replace(".base_layer.", "."): v for k, v in full_sd.items() if ".lora_" not in k}


def merged_state_dict(full_sd: dict, config) -> dict:
    """The base with each adapter's update added, W + (alpha / r)·B·A: PEFT's merge_and_unload, on tensors."""
    merged = base_state_dict(full_sd)
    scale = config.lora_alpha / config.r
    for k, a in full_sd.items():
        if k.endswith(f".lora_A.{ADAPTER}.weight"):
            prefix = k.removesuffix(f".lora_A.{ADAPTER}.weight")
            b = full_sd[f"{prefix}.lora_B.{ADAPTER}.weight"]
            w = merged[f"{prefix}.weight"]
            merged[f"{prefix}.weight"] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
    return merged


def adapter_state_dict(full_sd: dict) -> dict:
    """The adapters as PeftModel.save_pretrained names them (`base_model.model.<layer>.lora_A.weight`)."""
    return {
        "base_model.model." + k.replace(f".{ADAPTER}.", "."): v.contiguous()
        for k, v in full_sd.items()
        if ".lora_A." in k or ".lora_B." in k
    }


def write_adapter(full_sd: dict, lora: dict, folder: Path, base_path: str) -> None:
    """adapter_model.safetensors and adapter_config.json, as PeftModel.save_pretrained writes them."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = lora["config"]
    config.base_model_name_or_path = base_path
    save_file(adapter_state_dict(full_sd), str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(folder))
    (folder / "README.md").write_text(f"LoRA adapter (r={config.r}) for {base_path}; load: docs/lora.md\n")


def export_lora(task, full_sd: dict, output_dir: Path, data_source: dict, write_model) -> None:
    """Main process, under LoRA: OUTPUT/adapter (PEFT's files); OUTPUT/base, the frozen base the task's way,
    when it has no folder of its own (the built-in GPT, --model_config); OUTPUT/model, the merged model, with
    --merge_lora. `write_model(task, state_dict, folder, data_source)` writes a model folder whole (returns
    None, or the line saying why it could not)."""

    def write(state_dict: dict, folder: Path) -> None:
        failed = write_model(task, state_dict, folder, data_source)
        if failed:
            raise UsageError(failed)

    lora = task.lora
    base = lora["base"]
    if base is None or not Path(base).is_dir() and not _looks_like_hub_name(base):
        base = str((output_dir / "base").resolve())
        write(base_state_dict(full_sd), output_dir / "base")
    elif Path(base).is_dir():
        base = str(Path(base).resolve())
    tmp = output_dir / ".export_adapter"
    shutil.rmtree(tmp, ignore_errors=True)
    write_adapter(full_sd, lora, tmp, base)
    (tmp / "data.json").write_text(json.dumps(data_source, indent=1) + "\n")
    shutil.rmtree(output_dir / "adapter", ignore_errors=True)
    tmp.rename(output_dir / "adapter")
    if lora["merge"]:
        write(merged_state_dict(full_sd, lora["config"]), output_dir / "model")


def _looks_like_hub_name(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith((".", "/"))


def is_lora_layer(module: nn.Module) -> bool:
    return hasattr(module, "base_layer") and hasattr(module, "lora_A")


def lora_tp_plan(model: nn.Module, plan: dict) -> dict:
    """The TP plan with each adapted layer's entry spread over its parts (torchtitan's rule): the base layer
    cut as the plan says; beside a column-wise base, A whole (on the whole input) and B column-wise (each
    rank its outputs); beside a row-wise base, A row-wise (each rank its inputs, the rank-r result reduced
    as the base's output is) and B whole on that result (under sequence parallel a replicated DTensor on the
    sequence slice, its gradient summed over the ranks). No base weight is gathered. Any other style on an
    adapted layer is refused in one line."""
    from fnmatch import fnmatch

    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    layers = {n for n, m in model.named_modules() if is_lora_layer(m)}
    a, b = f"lora_A.{ADAPTER}", f"lora_B.{ADAPTER}"
    spread = {}
    for key, style in plan.items():
        parts = key.split(".")

        def matches(name, parts=parts):
            return len(name.split(".")) == len(parts) and all(map(fnmatch, name.split("."), parts))

        adapted = [n for n in layers if matches(n)]
        if not adapted:
            spread[key] = style
            continue
        out, local = getattr(style, "output_layouts", (None,))[0], getattr(style, "use_local_output", None)
        spread[f"{key}.base_layer"] = style
        if type(style) is ColwiseParallel:
            whole_input = PrepareModuleInput(
                input_layouts=style.input_layouts, desired_input_layouts=(Replicate(),), use_local_output=True
            )
            spread[f"{key}.{a}"] = whole_input
            spread[f"{key}.{b}"] = ColwiseParallel(output_layouts=out, use_local_output=local)
        elif type(style) is RowwiseParallel and (out == Shard(1) or out == Replicate() and local):
            spread[f"{key}.{a}"] = RowwiseParallel(
                input_layouts=style.input_layouts[0], output_layouts=out, use_local_output=local
            )
            if out == Shard(1):  # B on the sequence slice: its gradient summed over the ranks
                spread[f"{key}.{b}"] = SequenceParallel(use_local_output=local)
        else:
            raise UsageError(
                f"--lora_r: the TP plan cuts {adapted[0]} with {type(style).__name__}, which an adapter does not "
                f"follow (column- and row-wise only): leave {adapted[0].rsplit('.', 1)[-1]} out of "
                "--lora_target_modules, or train with train_fsdp.py"
            )
    return spread


def load_adapter(adapter_dir: Path, load_base):
    """An adapter folder the run wrote (evaluate.py --model_dir OUTPUT/adapter): its base, read by
    `load_base(folder) -> (model, task, data_source)`, with PEFT's PeftModel.from_pretrained, merged."""
    from peft import PeftModel

    base = json.loads((adapter_dir / "adapter_config.json").read_text())["base_model_name_or_path"]
    if not base or not Path(base).is_dir():
        raise UsageError(
            f"--model_dir {adapter_dir}: its base model {base!r} (adapter_config.json's base_model_name_or_path) is "
            "not a folder here: point it at the base model's folder"
        )
    model, task, data_source = load_base(Path(base))
    model = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    if (adapter_dir / "data.json").exists():  # the data the adapter learned, not the base's
        data_source = json.loads((adapter_dir / "data.json").read_text())
    return model, task, data_source
