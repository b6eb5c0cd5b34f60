"""Reading an exported model (OUTPUT_DIR/model) back, for scripts/evaluate.py and merge_checkpoints.py:
the built-in GPT and 🤗 models from their config.json, a model of your own through its Task (the file and
class that --task names, or that model/task.json recorded), with its build_model(config) and
validation_data(). Every failure is one line naming the flag and the fix. The training scripts never
import this module: writing the model is common/checkpoint.py's export_model."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import torch

from .checkpoint import TASK_FILE
from .errors import UsageError


def _why(error: Exception) -> str:
    """An exception as a few words for an error line: its type and the first line of its message."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:200]}" if text else type(error).__name__


def is_known_model(config: dict) -> bool:
    """A config.json that load_exported rebuilds by itself: a 🤗 model's or the built-in GPT's."""
    return "model_type" in config or {"n_layer", "n_head", "n_embd"} <= set(config)


def task_spec_for(model_dir, task_flag: str | None) -> tuple[str, str] | None:
    """Which Task of the user's own rebuilds the model in `model_dir`, as (FILE.py:Class or module:Class,
    who named it, for the error lines): --task if given; else, for a config.json that is neither the
    built-in GPT's nor a 🤗 model's, the one recorded in task.json; else None (a known model)."""
    if task_flag:
        return task_flag, f"--task {task_flag}"
    model_dir = Path(model_dir)
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except Exception:
        return None  # load_exported says what is wrong with the folder
    if not isinstance(config, dict) or is_known_model(config):
        return None
    if not (model_dir / TASK_FILE).is_file():
        raise UsageError(
            f"--model_dir {model_dir}: its config.json ({', '.join(config) or 'empty'}) is neither the built-in "
            f"GPT's nor a 🤗 model's, and no {TASK_FILE} says which Task wrote it: pass --task FILE.py:Class, the "
            "file and class of your Task, which must have build_model(config) and validation_data() "
            '(docs/your-model.md, "Evaluating your model with evaluate.py")'
        )
    try:
        recorded = json.loads((model_dir / TASK_FILE).read_text())
        spec = f"{recorded['file']}:{recorded['class']}"
    except Exception as e:
        raise UsageError(
            f"--model_dir {model_dir}: its {TASK_FILE} cannot be read ({_why(e)}): pass --task "
            "FILE.py:Class, the file and class of your Task"
        ) from None
    return spec, f"--model_dir {model_dir} (its {TASK_FILE} names {spec}; --task overrides it)"


def import_task_class(spec: str, named_by: str):
    """The Task subclass `spec` names: FILE.py:Class (the file's folder goes first on the path, so that it
    imports its neighbours) or module:Class (a module importable from the current directory)."""
    from .task import Task

    fix = "pass --task FILE.py:Class or module:Class, naming the subclass of common.task.Task that trained the model"
    where, colon, class_name = spec.rpartition(":")
    if not colon or not where or not class_name:
        raise UsageError(f"{named_by}: expected FILE.py:Class or module:Class (a colon, then the class name): {fix}")
    try:
        if where.endswith(".py") or os.sep in where or "/" in where:
            file = Path(where).expanduser().resolve()
            if not file.is_file():
                raise UsageError(f"{named_by}: there is no file {file}: {fix}")
            sys.path.insert(0, str(file.parent))
            name = file.stem if file.stem not in sys.modules else f"_task_file_{file.stem}"  # never shadow a module
            loaded = importlib.util.spec_from_file_location(name, file)
            module = importlib.util.module_from_spec(loaded)
            sys.modules[name] = module  # what dataclasses and pickle look the module up by
            loaded.loader.exec_module(module)
        else:
            sys.path.insert(0, os.getcwd())
            module = importlib.import_module(where)
    except UsageError:
        raise
    except Exception as e:
        raise UsageError(
            f"{named_by}: importing {where} failed ({_why(e)})"
            ": it must import as it does in the training run (run from the folder it was trained in?)"
        ) from None
    cls = module
    for part in class_name.split("."):
        cls = getattr(cls, part, None)
    tasks = [n for n, v in vars(module).items() if isinstance(v, type) and issubclass(v, Task) and v is not Task]
    has = f"its Task subclasses: {', '.join(tasks)}" if tasks else "it defines no subclass of common.task.Task"
    if cls is None:
        raise UsageError(f"{named_by}: {where} has no class {class_name!r} ({has}): {fix}")
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        what = "a class" if isinstance(cls, type) else f"a {type(cls).__name__}"
        raise UsageError(f"{named_by}: {class_name} is {what}, not a subclass of common.task.Task ({has}): {fix}")
    return cls


def load_own_model(model_dir: Path, spec: str, named_by: str):
    """A model of the user's own, rebuilt by its Task: `Task()` (no arguments), then
    `task.build_model(config)` with model/config.json, then model.safetensors loaded strictly; tied weights,
    saved once (common/task.py, write_model_dir), are one tensor again."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    cls = import_task_class(spec, named_by)
    try:
        task = cls()
    except Exception as e:
        raise UsageError(
            f"{named_by}: {cls.__name__}() failed ({_why(e)}): evaluate.py makes your Task with no "
            "arguments; give its __init__ arguments defaults"
        ) from None
    if not callable(getattr(task, "build_model", None)):
        raise UsageError(
            f"{named_by}: {cls.__name__} has no build_model(config): add `def build_model(self, config): return "
            "YourModel(...)` to it, building the model from config.json (what Task.config() wrote) "
            '(docs/your-model.md, "Evaluating your model with evaluate.py")'
        )
    config = json.loads((model_dir / "config.json").read_text())
    try:
        model = task.build_model(config)
    except Exception as e:
        raise UsageError(
            f"{named_by}: {cls.__name__}.build_model(config) failed ({_why(e)}) on config.json "
            f"({json.dumps(config)[:200]})"
        ) from None
    if not isinstance(model, torch.nn.Module):
        raise UsageError(
            f"{named_by}: {cls.__name__}.build_model(config) returned a {type(model).__name__}, not an nn.Module"
        )
    saved = load_file(str(model_dir / "model.safetensors"))
    with safe_open(str(model_dir / "model.safetensors"), "pt") as file:
        tied = json.loads((file.metadata() or {}).get("tied", "{}"))  # {name: the name its tensor was saved under}
    saved |= {name: saved[twin] for name, twin in tied.items() if twin in saved}
    expected = model.state_dict()
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    reshaped = [k for k in expected if k in saved and saved[k].shape != expected[k].shape]
    if missing or unexpected or reshaped:
        first = (
            f"{reshaped[0]}: {list(saved[reshaped[0]].shape)} in model.safetensors, {list(expected[reshaped[0]].shape)}"
            " in the model"
            if reshaped
            else f"{missing[0]}: absent in model.safetensors"
            if missing
            else f"{unexpected[0]}: absent in the model"
        )
        raise UsageError(
            f"--model_dir {model_dir}: model.safetensors does not fit the model {cls.__name__}.build_model(config) "
            f"built (first difference: {first}; {len(missing)} missing, {len(unexpected)} unexpected, {len(reshaped)} "
            "of another shape): make build_model(config) build the model that was trained, from config.json "
            "(what Task.config() wrote)"
        )
    model.load_state_dict(saved, strict=True)
    parameters = dict(model.named_parameters(remove_duplicate=False))
    for name, twin in tied.items():  # tied in training: tied again, whether build_model ties them or not
        if name in parameters and twin in parameters:
            owner, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(owner), attribute, parameters[twin])
    return model, task


def load_exported(model_dir, task_spec: tuple[str, str] | None = None):
    """Load `model/` on CPU: returns the model, its Task and the data source it was trained on. A
    folder written by a 🤗 model (config.json with a model_type) loads with transformers, the built-in
    GPT's with GPT; a model of the user's own is rebuilt by its Task (`task_spec`, from task_spec_for;
    without it, the Task that model/task.json records)."""
    from .gpt import GPT, GPTTask
    from .presets import GPTConfig

    model_dir = Path(model_dir)
    if (model_dir / "adapter_config.json").is_file():  # a LoRA adapter (PEFT's files): its base, merged with it
        from .lora import load_adapter

        return load_adapter(model_dir, lambda base: load_exported(base, task_spec))
    if (model_dir / "adapter_config.json").is_file():  # a LoRA adapter (PEFT's files): its base, merged with it
        from .lora import load_adapter

        return load_adapter(model_dir, lambda base: load_exported(base, task_spec))
    try:
        config = json.loads((model_dir / "config.json").read_text())
        data_source = json.loads((model_dir / "data.json").read_text()) if (model_dir / "data.json").exists() else {}
        if task_spec is None and not is_known_model(config):
            task_spec = task_spec_for(model_dir, None)
        if task_spec is not None:
            model, task = load_own_model(model_dir, *task_spec)
        elif "model_type" in config:
            from .hf import load_exported_hf

            model, task = load_exported_hf(model_dir)
        else:
            from safetensors.torch import load_file

            cfg = GPTConfig.from_dict(config)
            model = GPT(cfg)
            model.load_state_dict(load_file(str(model_dir / "model.safetensors")))
            task = GPTTask(cfg, cfg.block_size, "text")
    except UsageError:
        raise
    except Exception as e:
        raise UsageError(
            f"--model_dir {model_dir}: not a readable model directory "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    return model, task, data_source
