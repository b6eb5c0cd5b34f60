"""🤗 transformers causal LMs of any family (Llama, Qwen3, Mistral, Gemma 3, Phi-3, GPT-NeoX, Mixtral,
DeepSeek-V3, gpt-oss ...) behind the model contract (task.py).

A script's MODEL section swaps the built-in GPT for a 🤗 model with `load_hf_model`; the strategies
see only the Task and the model's own config. What each strategy reads of the model lives beside
this file, imported only for a 🤗 model: hf_tp.py builds the TP plan from `config.base_model_tp_plan`,
hf_pp.py the stages from `config.base_model_pp_plan`, hf_ep.py runs the experts found from
`config.base_model_ep_plan`. This file builds, loads, materialises and exports the model, and lets
train_cp.py replace its attention.

Two ways in, exactly one of them:
    --model_name_or_path  a pretrained model: a local folder (config.json + safetensors), or a hub name
                          read from the local 🤗 cache only (no download); its tokenizer comes with it.
    --model_config        random init from a config: a JSON file, a folder or cached hub name whose
                          config.json is read, or a model type ("llama", "qwen2") with small defaults.
                          Such models use the byte vocabulary of the built-in data (256 ids, no tokenizer).

Models are built in fp32 with SDPA attention (the family's eager attention where it has no SDPA) and
no KV cache, on the meta device; their weights are made module by module (materialize_hf), whole on
one rank or, after a strategy has cut the model, only each rank's part. The exported folder loads with
`AutoModelForCausalLM.from_pretrained`.
"""

from __future__ import annotations

import copy
import json
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn as nn

from .causal_lm import CausalLMTask
from .errors import UsageError
from .task import find_units, replace_dir

BYTE_VOCAB = 256  # the built-in data is UTF-8 bytes (common/data.py, common/model.py VOCAB_SIZE)
UNITS_PATH = "model.layers"
# --model_config <model type>: a small model that trains in minutes on a CPU (the GPT "small" preset's size).
# Keys are the Llama family's; max_position_embeddings is the run's context (--block_size, else SMALL_CONTEXT).
SMALL_CONTEXT = 128
# the context when --block_size is not given: the config's max_position_embeddings, at most this (pretrained
# models take 4k to 128k tokens: a CPU step would take minutes)
DEFAULT_CONTEXT = 1024
SMALL_DEFAULTS = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


# ---------------------------------------------------------------- resolving names (offline)


def _cached_folder(name: str) -> Path | None:
    """The local snapshot folder of hub model `name`, if its config.json is in the 🤗 cache. Never downloads:
    this machine may have no network, and a silent multi-GB download is not what a training flag should do."""
    from huggingface_hub import try_to_load_from_cache

    if Path(name).is_absolute() or name.count("/") > 1 or name.startswith("."):
        return None  # a path, not a hub name
    try:
        found = try_to_load_from_cache(name, "config.json")
    except Exception:  # invalid repo id (HFValidationError) and the like: not a hub name
        return None
    return Path(found).parent if isinstance(found, str) else None


def _model_folder(name: str, flag: str) -> Path:
    """A local folder holding `config.json`: `name` itself, or its snapshot in the 🤗 cache."""
    path = Path(name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UsageError(f"--{flag} {name}: the folder has no config.json; pass a 🤗 model folder")
        return path
    if path.exists():
        raise UsageError(f"--{flag} {name}: a file, not a folder; pass the model's folder (config.json + weights)")
    folder = _cached_folder(name)
    if folder is None:
        raise UsageError(
            f"--{flag} {name}: no such local folder, and not in the local 🤗 cache (no download is tried): "
            f"fetch it where there is network (`hf download {name}`) and copy the cache (HF_HOME) or the folder here"
        )
    return folder


def read_config(spec: str, context: int | None):
    """--model_config: a JSON file, a folder / cached hub name with config.json, or a model type name (then
    with SMALL_DEFAULTS and `context` positions; None: not known yet). -> (config, source for describe)"""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    path, model_type, values = Path(spec), None, None
    try:
        if path.is_file():
            try:
                values = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise UsageError(f"--model_config {spec}: not valid JSON ({e})") from None
            if not isinstance(values, dict) or "model_type" not in values:
                raise UsageError(f'--model_config {spec}: the JSON has no "model_type" (e.g. "llama", "qwen2"); add it')
            values = dict(values)
            model_type = values.pop("model_type")
            config, source = AutoConfig.for_model(model_type, **values), f"from config {path.name}"
        elif spec in CONFIG_MAPPING and not path.exists():
            model_type, values = spec, {**SMALL_DEFAULTS, "max_position_embeddings": context or SMALL_CONTEXT}
            config, source = AutoConfig.for_model(spec, **values), f"from config {spec} (small defaults)"
        else:
            folder = _model_folder(spec, "model_config")
            config, source = AutoConfig.from_pretrained(folder, local_files_only=True), f"from the config of {spec}"
    except UsageError:
        raise
    except StrictDataclassError as e:  # transformers' typed config fields and its checks of them
        raise UsageError(f"--model_config {spec}: {_config_error(e, model_type, values)}") from None
    except (ValueError, TypeError, KeyError, OSError, AttributeError) as e:  # unknown type, a bad field, custom code
        computed = " (the family computes it from other fields): remove it" if "has no setter" in str(e) else ""
        raise UsageError(f"--model_config {spec}: {_first_line(e)}{computed}") from None
    _check_config(config, f"--model_config {spec}")
    return config, source


def _config_error(e: Exception, model_type: str | None, values: dict | None) -> str:
    """What a config refused by transformers' strict validation needs, in words: the field, what it must be,
    and how to write it; or the hidden size that the attention heads must divide."""
    import re

    cause = e.__cause__ or e
    field = re.search(r"for field '([^']+)'", str(e))
    if field:
        wrong = re.search(r"expected (.+), got (\w+) \(value: (.*)\)", str(cause))
        if not wrong:
            return f"field {field[1]}: {_first_line(cause)}; fix it in the JSON"
        expected, got, value = wrong.groups()
        kind = expected.split()[0].split("[")[0]
        how = {
            "int": 'a whole number without quotes (64, not "64" or 64.0)',
            "float": 'a number without quotes (1e-05, not "1e-05")',
            "bool": "true or false, without quotes",
            "str": "a string in quotes",
        }.get(kind, expected)
        return f"field {field[1]} must be {expected}, not {got} {value}: write it as {how}"
    from types import SimpleNamespace

    fields = {name: _config_value(model_type, values, name) for name in ("hidden_size", "num_attention_heads")}
    return _heads_fix(SimpleNamespace(**fields), cause) or f"{_first_line(cause)}: fix the fields it names in the JSON"


def _heads_fix(config, e: Exception) -> str | None:
    """The line for a hidden size the attention heads do not divide (what a family checks in its config, or,
    as BLOOM and Falcon, when the model is built), or None."""
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    if not (isinstance(hidden, int) and isinstance(heads, int) and heads > 0 and hidden % heads):
        return None
    divisors = ", ".join(str(d) for d in range(1, min(hidden, 64) + 1) if hidden % d == 0)
    return (
        f"hidden_size {hidden} is not a multiple of num_attention_heads {heads} ({_first_line(e)}): set "
        f"num_attention_heads to a divisor of {hidden} ({divisors}), or hidden_size to a multiple of {heads}"
    )


def _config_value(model_type: str | None, values: dict | None, name: str):
    """The value of config field `name` (a standard name: hidden_size, num_attention_heads) as the JSON gives
    it, under the family's own name (BLOOM's n_head ...), else the family's default; None if unknown."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        return None
    config_class = CONFIG_MAPPING[model_type]
    own_name = getattr(config_class, "attribute_map", {}).get(name, name)
    for key in (own_name, name):
        if values and key in values:
            return values[key]
    try:
        return getattr(config_class(), name, None)
    except Exception:  # a family whose defaults do not build alone
        return None


def _check_config(config, what: str) -> None:
    """What transformers accepts in a config but no strategy can train as transformers means it, one line each:
    - grouped KV heads that do not divide the query heads (the attention fails at the first forward);
    - a sliding window of 0 or fewer tokens on a layer that uses it: transformers' sdpa and eager attention
      compute different things with it and its KV cache fails, so no layout could match another."""
    heads, kv = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(kv, int) and kv > 0 and heads % kv:
        divisors = ", ".join(str(d) for d in range(1, heads + 1) if heads % d == 0)
        raise UsageError(
            f"{what}: num_key_value_heads {kv} does not divide num_attention_heads {heads} (each KV head serves "
            f"a group of query heads): set num_key_value_heads to one of {divisors}"
        )
    window, layer_types = getattr(config, "sliding_window", None), getattr(config, "layer_types", None)
    in_use = layer_types is None or "sliding_attention" in layer_types
    if isinstance(window, (int, float)) and not isinstance(window, bool) and window <= 0 and in_use:
        context = getattr(config, "max_position_embeddings", None)
        no_limit = f" ({context} or more: no limit)" if context else ""
        raise UsageError(
            f"{what}: sliding_window {window} leaves a query no token to attend to, and transformers' own attention "
            "disagrees with itself on it (sdpa and eager differ, its KV cache fails): set sliding_window to the "
            f"tokens each query sees, a positive number{no_limit}"
        )


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


@contextmanager
def _no_progress_bars():
    """🤗 draws bars for loading and writing weights, on every rank: off while we load or save."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


# ---------------------------------------------------------------- building


def hf_context_length(args) -> int:
    """The longest sequence the model takes, before it exists (what the data is cut to): --block_size (checked
    against the config's max_position_embeddings), else that, up to DEFAULT_CONTEXT; SMALL_CONTEXT for a
    model type's small defaults."""
    block = getattr(args, "block_size", None)
    if getattr(args, "model_config", None):
        config, source = read_config(args.model_config, block)
        if source.endswith("(small defaults)"):
            config = None  # its max_position_embeddings is what we make it
    else:
        _, config = _pretrained_config(args.model_name_or_path)
    limit = getattr(config, "max_position_embeddings", None)
    if block and limit and block > limit:  # rotary embeddings would run on positions the model never saw
        raise UsageError(
            f"--block_size {block} is longer than the model's max_position_embeddings ({limit}): use --block_size "
            f"<= {limit}" + (", or raise max_position_embeddings in the config" if args.model_config else "")
        )
    return block or (min(limit, DEFAULT_CONTEXT) if limit else SMALL_CONTEXT)


def load_hf_model(args, seq_len: int, data_task: str, tokenizer="auto", on_meta: bool = False):
    """-> (model, HFCausalLMTask) from args.model_name_or_path or args.model_config (exactly one).

    Call `set_seed` first: a model built from a config is initialised from torch's RNG, so every rank
    builds the same weights. `tokenizer`: what load_tokenizer(args) returned (the data was encoded with
    it); "auto" loads it here. `on_meta`: return the model on the meta device (no weights yet), for a
    strategy that cuts it first and then makes only its own part (materialize_hf); else the whole model
    on the CPU. Raises UsageError, one line, for anything the user can fix."""
    from transformers import AutoModelForCausalLM

    name, spec = getattr(args, "model_name_or_path", None), getattr(args, "model_config", None)
    if bool(name) == bool(spec):
        raise UsageError(
            "pass exactly one of --model_name_or_path (a pretrained 🤗 model) and --model_config (a random-init "
            f"🤗 model from a config): got {'both' if name else 'neither'}"
        )
    if isinstance(tokenizer, str) and tokenizer == "auto":
        tokenizer = load_tokenizer(args)
    # fp32 (🤗 would otherwise take the checkpoint's or config's dtype, often bf16); SDPA attention, which with
    # no padding mask runs is_causal=True (deterministic on CPU); no KV cache in training
    build = {"dtype": torch.float32, "attn_implementation": "sdpa"}
    if spec:
        config, source = read_config(spec, max(seq_len, getattr(args, "block_size", None) or SMALL_CONTEXT))
        check_causal_lm(config, f"--model_config {spec}")
        # the built-in data is bytes: the model reads and predicts 256 ids; no special tokens among them
        config.vocab_size = BYTE_VOCAB
        config.pad_token_id = config.bos_token_id = config.eos_token_id = None
        # untied, like the built-in GPT: TP shards the two apart and PP puts them on different stages
        config.tie_word_embeddings = False
        config.use_cache = False
        try:  # on the meta device: the weights are made module by module (materialize_hf), on any layout
            with torch.device("meta"):
                model = _with_attention(lambda **b: AutoModelForCausalLM.from_config(config, **b), build)
        except (ValueError, TypeError) as e:
            raise UsageError(f"--model_config {spec}: {_heads_fix(config, e) or _first_line(e)}") from None
        weights = None  # random init
    else:
        folder, config = _pretrained_config(name)
        config.use_cache = False
        weights = _safetensors_names(folder) if on_meta else None  # {name: file}: each rank reads its slices
        if weights is not None:
            with torch.device("meta"):
                model = _with_attention(lambda **b: AutoModelForCausalLM.from_config(config, **b), build)
            if getattr(args, "untie_embeddings", False):
                untie_embeddings(model)
            weights = _weights_by_parameter(model, weights)  # None where the names differ (a converted format)
    if spec is None and weights is None:  # the whole model on every rank, as from_pretrained loads it
        try:
            with _no_progress_bars():
                model = _with_attention(
                    lambda **b: AutoModelForCausalLM.from_pretrained(folder, config=config, local_files_only=True, **b),
                    build,
                )
        except (OSError, ValueError, TypeError, KeyError) as e:  # no weights, custom code ...
            raise UsageError(f"--model_name_or_path {name}: could not load it ({_first_line(e)})") from None
        if getattr(args, "untie_embeddings", False):
            untie_embeddings(model)
    source = source if spec else f"pretrained {name}"
    if on_meta and not is_on_meta(model):  # asked for the meta device, but the file needs transformers' loader
        source += ", loaded whole on every rank: its files' tensor names are not the model's"
    what = f"--model_config {spec}" if spec else f"--model_name_or_path {name}"
    _check_loss_is_ours(model.config, what)
    _name_the_base_model(model)
    units_path = find_units_path(model, what)
    check_vocab_fits(model, tokenizer)
    model.train()  # from_pretrained returns it in eval mode
    task = HFCausalLMTask(seq_len, data_task, model.config, source, tokenizer, units_path)
    if getattr(args, "document_mask", False):
        check_takes_position_ids(model)
    task.weights = weights  # {parameter or buffer name: (file, name in it)} for a model on meta; None: random init
    if is_on_meta(model) and not on_meta:
        model.to_empty(device="cpu")
        materialize_hf(model, task)  # the whole model, made as a sharded run makes its parts
    if getattr(args, "document_mask", False) and not is_on_meta(model):  # on meta: Task.check, before step 1
        task.check_documents_apart(model)
    return model, task


def check_takes_position_ids(model: nn.Module) -> None:
    """--document_mask gives a 🤗 model position_ids as its third positional input (HFCausalLMTask.inputs):
    its forward must read them there."""
    import inspect

    params = list(inspect.signature(model.forward).parameters)[:3]
    if params != ["input_ids", "attention_mask", "position_ids"]:
        raise UsageError(
            f"--document_mask: {model.config.model_type}'s forward takes ({', '.join(params)}) first, not (input_ids, "
            "attention_mask, position_ids), so its documents' positions have nowhere to go: train without "
            "--document_mask"
        )


def _check_loss_is_ours(config, what: str) -> None:
    """The scripts' loss is the next-token cross-entropy, summed (CausalLMTask). A config that asks its
    forward for more (output_router_logits: an MoE's auxiliary balance loss) would be silently dropped:
    refused, one line, unless its weight is 0. Families name the weight differently (JetMoE's aux_loss_coef,
    DBRX's ffn_config.moe_loss_weight), so a weight under no name read here counts as not 0."""
    if not getattr(config, "output_router_logits", False):
        return
    weights = [getattr(config, n, None) for n in ("router_aux_loss_coef", "aux_loss_coef")]
    weights.append(getattr(getattr(config, "ffn_config", None), "moe_loss_weight", None))
    named = [w for w in weights if w is not None]
    if named and not any(named):
        return
    weight = next((w for w in named if w), "under a name of its own")
    raise UsageError(
        f"{what}: {config.model_type}'s config asks for its auxiliary balance loss (output_router_logits, "
        f"weight {weight}), which the scripts' loss does not hold: a "
        "mean over each forward's tokens, it does not add up over data-parallel ranks or micro-batches, so no "
        "layout would compute the one-process loss; set output_router_logits false in the config"
    )


def is_on_meta(model: nn.Module) -> bool:
    return any(t.device.type == "meta" for t in model.parameters())


def _post_order(module: nn.Module, init_fn):
    """(module, its init function) in the order transformers' initialize_weights visits them (children
    first; a sub-model such as the base model brings its own _initialize_weights)."""
    from transformers import PreTrainedModel

    for child in module.children():
        yield from _post_order(child, child._initialize_weights if isinstance(child, PreTrainedModel) else init_fn)
    yield module, init_fn


def _is_custom_code(model: nn.Module) -> bool:
    """transformers' is_custom_code of the model's own class. fully_shard puts the model in a class made in torch
    (FSDP<Name>), which would count as custom code: its init then skips every module owning no parameter (the
    MoE blocks that initialise their routers)."""
    return next(c for c in type(model).__mro__ if not c.__module__.startswith("torch.")).is_custom_code()


def _init_order(model: nn.Module) -> list:
    """[(module, its init function)], each module once: a module reached twice is initialised at its first
    visit (transformers marks it _is_hf_initialized then)."""
    seen, order = set(), []
    for module, init_fn in _post_order(model, model._initialize_weights):
        if id(module) not in seen:
            seen.add(id(module))
            order.append((module, init_fn))
    return order


def _slots(module: nn.Module) -> list:
    """(owner, name) of every parameter and buffer of `module` and its children."""
    return [(m, n) for m in module.modules() for n, t in (*m._parameters.items(), *m._buffers.items()) if t is not None]


def _in_slot(owner: nn.Module, name: str):
    return owner._parameters[name] if name in owner._parameters else owner._buffers[name]


@contextmanager
def _standing_in(stand_ins: dict, slots_of: dict):
    """Every slot holding the tensor with id `i` holds stand_ins[i] (a Parameter where a parameter sits, one
    object for all of a tied tensor's slots); the tensors are put back after."""
    put_back = []
    for i, stand_in in stand_ins.items():
        for owner, name in slots_of[i]:
            put_back.append((owner, name, _in_slot(owner, name)))
            if name in owner._parameters:
                owner._parameters[name] = stand_in
            else:
                owner._buffers[name] = stand_in
    try:
        yield
    finally:
        for owner, name, tensor in reversed(put_back):
            if name in owner._parameters:
                owner._parameters[name] = tensor
            else:
                owner._buffers[name] = tensor


def _stand_in(tensor, like, device) -> torch.Tensor:
    """`tensor`, or a new one of `like`'s shape and dtype on `device`, as a Parameter where `like` is one."""
    if tensor is None:
        tensor = torch.empty(like.shape, dtype=like.dtype, device=device)
    return nn.Parameter(tensor, requires_grad=like.requires_grad) if isinstance(like, nn.Parameter) else tensor


@contextmanager
def _init_primitives_count_as_writes():
    """torch.nn.init's trunc_normal_, orthogonal_, dirac_ and sparse_ return at once on a meta tensor, without
    the in-place op that bumps its version counter: while inits run on meta stand-ins, every init primitive
    bumps it, as a write does (transformers' go through TORCH_INIT_FUNCTIONS, and torch.nn.init's too under
    guard_torch_init_functions)."""
    from torch.autograd.graph import increment_version
    from transformers import initialization as hf_init

    originals = dict(hf_init.TORCH_INIT_FUNCTIONS)

    def counted(primitive):
        def init_primitive(tensor, *args, **kwargs):
            out = primitive(tensor, *args, **kwargs)
            increment_version(tensor)
            return out

        return init_primitive

    hf_init.TORCH_INIT_FUNCTIONS.update({name: counted(f) for name, f in originals.items()})
    try:
        yield
    finally:
        hf_init.TORCH_INIT_FUNCTIONS.update(originals)


def writes_of_each_init(order: list, slots_of: dict, custom: bool) -> list:
    """For each (module, init) of `order`, the ids of the parameters and buffers its init writes: its own, and
    any of its children's (Qwen3-Next's MoE block initialises its router's weight; the router's own init
    does not). Found by running every init once on meta stand-ins (no memory; the RNG state is put back) and
    reading their version counters. An init that cannot run on meta is given its whole subtree."""
    stand_ins = {i: _stand_in(None, _in_slot(*slots[0]), "meta") for i, slots in slots_of.items()}
    tensor_of = {id(s): i for i, s in stand_ins.items()}
    writes = []
    from transformers import initialization as hf_init

    counted = _init_primitives_count_as_writes()
    with _standing_in(stand_ins, slots_of), hf_init.guard_torch_init_functions(), counted, torch.random.fork_rng([]):
        for module, init_fn in order:
            inside = _slots(module)
            before = [(_in_slot(*slot), _in_slot(*slot)._version) for slot in inside]
            module.__dict__.pop("_is_hf_initialized", None)
            try:
                init_fn(module, custom)
                wrote = [s is not _in_slot(*slot) or s._version != v for slot, (s, v) in zip(inside, before)]
            except Exception:  # it reads values: whole CPU tensors, as transformers gives it
                wrote = [True] * len(inside)
            module.__dict__.pop("_is_hf_initialized", None)
            writes.append({tensor_of[id(s)] for (s, _), w in zip(before, wrote, strict=True) if w})
            for (owner, name), (s, _) in zip(inside, before):  # a stand-in the init replaced goes back
                if name in owner._parameters:
                    owner._parameters[name] = s
                else:
                    owner._buffers[name] = s
    return writes


@torch.no_grad()
def materialize_hf(model: nn.Module, task) -> None:
    """Make the weights of a 🤗 model built on the meta device, wherever its parameters now are: whole, or
    this rank's part as DTensors (after fully_shard or parallelize_module, then model.to_empty(device)).
    One module at a time, each parameter is made whole on the CPU, then this rank's part is copied in, so no
    rank holds more than one module's whole weights (and a child's a parent's init writes, until then):
    - random init (task.weights None): transformers' own init, module by module in its own order (children
      first) from the seeded RNG, exactly as its initialize_weights gives: the same weights on every layout
      (not those from_config draws: its layers' own constructors draw from the RNG first). A module's init may
      write a child's tensor (Qwen3-Next's MoE block its router's weight): which it writes is found first
      (writes_of_each_init), and that tensor stays whole on the CPU until its last writer has run;
    - pretrained: read from the safetensors files, only this rank's slice of each tensor (an init that would
      write one writes a meta stand-in, marked initialised as transformers marks loaded tensors).
    The rotary embeddings' buffers are computed by their init in both cases."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from transformers import initialization as hf_init

    weights, custom, files = task.weights, _is_custom_code(model), {}

    def part_of(t, whole):  # this rank's part of a whole tensor, as t holds it
        if isinstance(t, DTensor):
            return distribute_tensor(whole, t.device_mesh, t.placements, src_data_rank=None).to_local()
        return whole

    def read_part(t, where):  # only this rank's slice, from the file
        file, key = where
        if file not in files:
            files[file] = safe_open(file, framework="pt")
        sliced = files[file].get_slice(key)
        if isinstance(t, DTensor):
            shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            sliced = sliced[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
        else:
            sliced = sliced[:]
        return sliced.to(t.dtype)

    def copy_in(t, part):
        (t.to_local() if isinstance(t, DTensor) else t).copy_(part)

    order = _init_order(model)
    slots_of, tensors = {}, {}  # tensor id -> every (owner, name) holding it; tensor id -> the tensor
    for module, _ in order:
        for name, t in (*module._parameters.items(), *module._buffers.items()):
            if t is not None:
                slots_of.setdefault(id(t), []).append((module, name))
                tensors[id(t)] = t
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    from_file = {}  # tensor id -> (file, key), the name of its first slot (the one state_dict gives)
    for i, slots in slots_of.items():
        owner, name = slots[0]
        qualified = f"{names[id(owner)]}.{name}".lstrip(".")
        if weights is not None and qualified in weights:
            from_file[i] = weights[qualified]
    writes = writes_of_each_init(order, slots_of, custom)
    last_writer = {}  # tensor id -> the index in `order` after which its whole value is final
    for index, (module, _) in enumerate(order):
        for i in [id(t) for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]:
            last_writer.setdefault(i, index)  # its owner's, or
        for i in writes[index]:
            last_writer[i] = max(last_writer.get(i, index), index)  # the last init that writes it

    whole = {}  # tensor id -> its whole value on the CPU, from its owner's turn until its last writer's
    read = set()  # the tensors read from the files (a tied one once)
    with hf_init.guard_torch_init_functions():
        for index, (module, init_fn) in enumerate(order):
            own = [id(t) for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]
            for i in own:
                if i in from_file and i not in read:
                    copy_in(tensors[i], read_part(tensors[i], from_file[i]))
                    read.add(i)
            made = {i for i in (*own, *writes[index]) if i not in from_file}
            for i in made:
                whole.setdefault(i, _stand_in(None, tensors[i], "cpu"))
            loaded = {}
            for i in writes[index] & from_file.keys():  # transformers would skip a loaded tensor: so do we
                loaded[i] = _stand_in(None, tensors[i], "meta")
                loaded[i]._is_hf_initialized = True
            if made or writes[index]:
                with _standing_in({**{i: whole[i] for i in made}, **loaded}, slots_of):
                    module.__dict__.pop("_is_hf_initialized", None)
                    init_fn(module, custom)
                    for i in made:  # an init may put a new tensor in the slot
                        whole[i] = _stand_in(_in_slot(*slots_of[i][0]).detach(), tensors[i], "cpu")
            for i in [i for i in whole if last_writer[i] == index]:
                copy_in(tensors[i], part_of(tensors[i], whole.pop(i).detach()))
            module.__dict__.pop("_is_hf_initialized", None)


def _safetensors_names(folder: Path) -> dict | None:
    """{tensor name: its safetensors file} of a pretrained folder, or None without safetensors files."""
    from safetensors import safe_open

    index = Path(folder) / "model.safetensors.index.json"
    if index.is_file():
        return {k: str(Path(folder) / f) for k, f in json.loads(index.read_text())["weight_map"].items()}
    single = Path(folder) / "model.safetensors"
    if not single.is_file():
        return None
    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), str(single))


def _weights_by_parameter(model: nn.Module, names: dict) -> dict | None:
    """{parameter or persistent buffer name: (file, name in the file)}, or None where the file's names are
    not the model's (a format transformers converts while loading): the model is then loaded whole."""
    wanted = [n for n, _ in model.named_parameters()]
    modules = model.named_modules()
    non_persistent = {f"{m}.{b}".lstrip(".") for m, mod in modules for b in mod._non_persistent_buffers_set}
    wanted += [n for n, _ in model.named_buffers() if n not in non_persistent]
    tied = {}
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and embed is not None:  # an untied head from a tied checkpoint: the embedding's values
        names_of = {m: n for n, m in model.named_modules()}
        tied[f"{names_of[head]}.weight"] = f"{names_of[embed]}.weight"
    out = {}
    for n in wanted:
        key = n if n in names else tied.get(n)
        if key not in names:
            return None
        out[n] = (names[key], key)
    return out


def _with_attention(build_model, build: dict) -> nn.Module:
    """SDPA attention where the family supports it, else its own eager attention (gpt-oss: its attention
    sinks are not SDPA's); both compute the same scores in fp32."""
    try:
        return build_model(**build)
    except ValueError as e:
        if "scaled_dot_product_attention" not in str(e):
            raise
        return build_model(**{**build, "attn_implementation": "eager"})


def load_exported_hf(model_dir, data_task: str = "text"):
    """A folder HFCausalLMTask.export wrote (or any 🤗 causal LM folder), on the CPU in fp32, with its tokenizer
    if it has one (task.tokenizer: encode the evaluation data with it). -> (model, task)"""
    from types import SimpleNamespace

    args = SimpleNamespace(model_name_or_path=str(model_dir), model_config=None)
    return load_hf_model(args, hf_context_length(args), data_task)


def _pretrained_config(name: str):
    """--model_name_or_path: (its folder, its config), checked to be a causal LM."""
    from transformers import AutoConfig

    folder = _model_folder(name, "model_name_or_path")
    from huggingface_hub.errors import StrictDataclassError

    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except StrictDataclassError as e:  # transformers' typed config fields and its checks of them
        raise UsageError(f"--model_name_or_path {name}: its config.json: {_config_error(e, None, None)}") from None
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:  # a bad config.json, custom code ...
        raise UsageError(f"--model_name_or_path {name}: could not read its config ({_first_line(e)})") from None
    check_causal_lm(config, f"--model_name_or_path {name}")
    _check_config(config, f"--model_name_or_path {name}")
    return folder, config


def check_causal_lm(config, what: str) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if getattr(config, "is_encoder_decoder", False) or config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UsageError(
            f"{what}: model type {config.model_type!r} is not a decoder-only causal LM "
            "(AutoModelForCausalLM); use one such as llama, qwen3, mistral, gemma3_text, phi3, mixtral"
        )


def _name_the_base_model(model: nn.Module) -> None:
    """Llama 4's text model is named `language_model` (base_model_prefix), as in the multimodal model, but is
    held as `model`: model.base_model was then the whole model. The one child that is a 🤗 model is the base."""
    from transformers import PreTrainedModel

    if getattr(model, model.base_model_prefix or "", None) is None:
        bases = [n for n, m in model.named_children() if isinstance(m, PreTrainedModel)]
        if len(bases) == 1:
            model.base_model_prefix = bases[0]  # this instance's; the class keeps its own


def find_units_path(model: nn.Module, what: str) -> str:
    """Where the decoder layers are, the units every strategy cuts at: the base model's ModuleList, e.g.
    "model.layers" (Llama, Qwen, Mistral, Gemma ...) or "gpt_neox.layers" (GPT-NeoX / Pythia). The family's
    base_model_pp_plan names its parts in order (embedding, layers, final norm): its ModuleList is taken
    first, else the base model's only ModuleList, else the only one a floor down ("model.decoder.layers")."""
    prefix = model.base_model_prefix
    inner = getattr(model, prefix, None) if prefix else None
    if inner is None:
        found = ", ".join(n for n, _ in model.named_children())
        raise UsageError(f"{what}: {type(model).__name__} has no base model (it has: {found}); pass a causal LM")
    names = list(getattr(model.config, "base_model_pp_plan", None) or {}) or [n for n, _ in inner.named_children()]
    lists = [n for n in names if isinstance(getattr(inner, n, None), nn.ModuleList)]
    if not lists:  # OPT keeps them a floor down: model.decoder.layers
        lists = [
            f"{n}.{m}" for n, c in inner.named_children() for m, s in c.named_children() if isinstance(s, nn.ModuleList)
        ]
    if len(lists) != 1:
        found = ", ".join(n for n, _ in inner.named_children())
        raise UsageError(
            f"{what}: {type(model).__name__} keeps no single list of decoder layers in {prefix} (it has: {found}): "
            "the strategies cut a model at its decoder layers; pass a decoder-only model with one layer stack"
        )
    path = f"{prefix}.{lists[0]}"
    find_units(model, path)
    return path


def is_tied(model: nn.Module) -> bool:
    """lm_head shares its weight with embed_tokens (tie_word_embeddings)."""
    emb, head = model.get_input_embeddings(), getattr(model, "lm_head", None)
    return emb is not None and head is not None and head.weight is emb.weight


def untie_embeddings(model: nn.Module) -> None:
    """Give lm_head a weight of its own, a copy of the embedding's (trained apart from then on)."""
    if is_tied(model):
        emb = model.get_input_embeddings().weight
        model.lm_head.weight = nn.Parameter(emb.detach().clone(), requires_grad=emb.requires_grad)
    model.config.tie_word_embeddings = False


def check_untied(model: nn.Module, strategy: str) -> None:
    """TP shards lm_head and embed_tokens separately, PP puts them on different stages: a shared
    weight would silently become two. Refuse rather than train something else than asked."""
    if is_tied(model):
        raise UsageError(
            f"the model ties lm_head to embed_tokens (tie_word_embeddings), which {strategy} cannot keep: "
            "train it with train_ddp.py or train_fsdp.py, or pass --untie_embeddings (lm_head starts as a "
            "copy of the embedding)"
        )


def check_vocab_fits(model: nn.Module, tokenizer) -> None:
    """Every id the data can hold must have a row in the embedding: the tokenizer's, or the 256 bytes."""
    rows = model.get_input_embeddings().num_embeddings
    if tokenizer is not None:
        need, what = len(tokenizer), f"the tokenizer ({type(tokenizer).__name__})"
    else:
        need, what = BYTE_VOCAB, "the byte-level data (no tokenizer in --model_name_or_path)"
    if need > rows:
        raise UsageError(
            f"{what} has {need} ids but the model's embedding only {rows} rows: pass a model whose vocabulary "
            "fits (vocab_size), or a folder holding the tokenizer it was trained with"
        )


# ---------------------------------------------------------------- tokenizer


def load_tokenizer(args):
    """The tokenizer that comes with --model_name_or_path (a folder, or the cached hub snapshot, holding
    tokenizer files), else None: the data stays bytes. --model_config models always use bytes."""
    name = getattr(args, "model_name_or_path", None)
    if not name or getattr(args, "model_config", None):
        return None
    folder = _model_folder(name, "model_name_or_path")
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise UsageError(f"--model_name_or_path {name}: could not load its tokenizer ({_first_line(e)})") from None


# ---------------------------------------------------------------- the contract


REPLACED_ATTENTION = "replaced_attention"  # the name HFCausalLMTask.set_attention registers (context parallelism)


class HFCausalLMTask(CausalLMTask):
    """CausalLMTask for a 🤗 model: units at model.layers, outputs are 🤗 objects (`.logits`, read by
    CausalLMTask), and the export is a 🤗 folder (save_pretrained) with the tokenizer, if any."""

    name = "hf_causal_lm"

    def __init__(self, seq_len: int, data_task: str, hf_config, source: str, tokenizer=None, units_path=UNITS_PATH):
        super().__init__(seq_len, data_task)
        self.units_path = units_path  # the decoder layers: "model.layers", "gpt_neox.layers" ...
        self.attn_implementation = hf_config._attn_implementation  # "sdpa", or "eager" (_with_attention)
        self.hf_config = hf_config
        self.source = source  # "from config tiny.json", "pretrained Qwen/Qwen2-0.5B" (for describe)
        self.tokenizer = tokenizer
        self._runs_with_attention_replaced = set()  # ids of the models checked (check_ring_computes)

    def inputs(self, batch) -> tuple:
        """model(input_ids), or with --document_mask model(input_ids, None, position_ids): transformers masks
        packed documents by their restarting positions (check_takes_position_ids, check_documents_apart)."""
        if "position_ids" in batch:
            return batch["input_ids"], None, batch["position_ids"]
        return (batch["input_ids"],)

    def describe(self, model: nn.Module) -> str:
        c = self.hf_config
        n = sum(p.numel() for p in model.parameters())  # a DTensor counts its full size
        heads = getattr(c, "num_attention_heads", None)  # Mamba: none
        kv = getattr(c, "num_key_value_heads", None) or heads
        attention = f"{heads} heads / {kv} KV heads" if heads else "no attention heads"
        if self.tokenizer is not None:
            vocab = f"vocabulary {c.vocab_size} (tokenizer {type(self.tokenizer).__name__}, {len(self.tokenizer)} ids)"
        elif c.vocab_size == BYTE_VOCAB:
            vocab = f"vocabulary {BYTE_VOCAB} (bytes)"
        else:
            vocab = f"vocabulary {c.vocab_size} (no tokenizer: the data's bytes are ids 0-255)"
        tied = ", tied embeddings" if c.tie_word_embeddings else ""
        return (
            f"model {c.model_type} (🤗 transformers, {self.source}): {n / 1e6:.2f}M parameters, "
            f"{c.num_hidden_layers} layers x {c.hidden_size} wide, {attention}, "
            f"{vocab}{tied}"
        )

    def config(self) -> dict:
        return json.loads(self.hf_config.to_json_string(use_diff=False))

    def flops_per_item(self, n_params: int) -> float:
        """Per token: 6N (forward + backward matmuls) + 12·L·(heads·head_dim)·T (attention scores), as GPT's."""
        c, heads = self.hf_config, getattr(self.hf_config, "num_attention_heads", None) or 0
        width = heads * (getattr(c, "head_dim", None) or c.hidden_size // max(heads, 1))  # 0: no attention
        return 6 * n_params + 12 * c.num_hidden_layers * width * self.tokens_per_sample

    def export(self, state_dict: dict, model_dir, data_source: dict) -> None:
        """A folder `AutoModelForCausalLM.from_pretrained` loads (config.json, model.safetensors, generation
        config) plus data.json and the tokenizer the data was encoded with; written beside and renamed in."""
        model_dir = Path(model_dir)
        tmp = model_dir.with_name(f".tmp_{model_dir.name}")
        shutil.rmtree(tmp, ignore_errors=True)
        model = self._model_with(state_dict)
        with _no_progress_bars():
            model.save_pretrained(tmp)
        (tmp / "data.json").write_text(json.dumps(data_source, indent=1))
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(tmp)
        replace_dir(tmp, model_dir)

    def materialize(self, model: nn.Module) -> None:
        """The weights of a model built on the meta device (load_hf_model(on_meta=True)), once a strategy has cut
        it and moved it with model.to_empty(device): this rank's parts only (materialize_hf)."""
        materialize_hf(model, self)

    # --- context parallelism (train_cp.py): the attention is replaceable, the positions are given
    def set_attention(self, model: nn.Module, attention) -> None:
        """Every decoder layer calls `attention(q, k, v)` on (batch, heads, tokens, head_dim), causal, in place
        of SDPA, through transformers' AttentionInterface (None: the model's own again, after checking that the
        ring computes this family's attention: check_ring_computes). Grouped KV heads are repeated to the query
        heads first; a family's own score scale (Gemma 3's query_pre_attn_scalar, DeepSeek-V3's) is put on the
        queries, since the ring scales by 1/sqrt(head_dim); the mask transformers would build is not needed
        (the function is causal, and takes the layer's sliding window, sinks and soft-capping as keywords)."""
        self.check_ring_computes(model)
        if attention is None:
            model.config._attn_implementation = self.attn_implementation  # as load_hf_model built it
            return
        self._install_attention(model, attention)

    def _install_attention(self, model: nn.Module, attention) -> None:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        def replaced_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
            if scaling is not None and abs(scaling - query.shape[-1] ** -0.5) > 1e-9:
                query = query * (scaling * query.shape[-1] ** 0.5)  # q·k · scaling = (q · c)·k / sqrt(head_dim)
            n_rep = query.shape[1] // key.shape[1]  # grouped-query attention: each KV head serves n_rep heads
            if n_rep > 1:
                key, value = key.repeat_interleave(n_rep, dim=1), value.repeat_interleave(n_rep, dim=1)
            v_dim = value.shape[-1]
            if v_dim < key.shape[-1]:  # DeepSeek-V3's latent attention: narrower values; the ring sends k, v stacked
                value = nn.functional.pad(value, (0, key.shape[-1] - v_dim))  # zero columns out, cut off below
            masks = {  # what the family's layer declares: its window (None on full layers), sinks, soft-capping
                "window": kwargs.get("sliding_window"),
                "sinks": kwargs.get("s_aux"),
                "softcap": kwargs.get("softcap"),
                "documents": self.documents,  # the whole sequences' document ids (forward_at's), or None
            }
            masks = {k: v for k, v in masks.items() if v is not None}
            out = attention(query, key, value, dropout_p=dropout, **masks)[..., :v_dim]
            return out.transpose(1, 2).contiguous(), None  # transformers wants (B, T, H, D)

        AttentionInterface.register(REPLACED_ATTENTION, replaced_attention)
        AttentionMaskInterface.register(REPLACED_ATTENTION, lambda *args, **kwargs: None)  # no mask tensor
        model.config._attn_implementation = REPLACED_ATTENTION

    def check_ring_computes(self, model: nn.Module) -> None:
        """Context parallelism computes causal softmax attention with what a family's layers pass to the
        attention function (each layer's sliding window, gpt-oss's sinks, Gemma 2's soft-capping, the score scale);
        what it does not compute is refused before training, one line, rather than trained on other scores:
        a forward that fails with the attention replaced; attention dropout, under whatever name the config
        gives it, is asked for as dropout_p in training (cp_checks.check_cp)."""
        self._check_runs_with_attention_replaced(model)

    def _check_runs_with_attention_replaced(self, model: nn.Module) -> None:
        """A family whose layers compute attention themselves (Falcon) takes its eager path once the attention
        is one it does not know, and adds the mask transformers no longer builds: a TypeError deep in the model.
        One 2-token forward with a plain causal attention in place, once per model, turns that into one line."""
        if id(model) in self._runs_with_attention_replaced:
            return
        calls = []

        def counting_attention(query, key, value, **masks):
            calls.append(query.shape)
            return nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True)

        device, was_training = next(model.parameters()).device, model.training
        model.eval()
        self._install_attention(model, counting_attention)
        try:
            with torch.no_grad():
                ids, positions = torch.zeros(1, 2, dtype=torch.long, device=device), torch.arange(2, device=device)
                self.forward_at(model, ids, positions)
        except Exception as e:
            family = self.hf_config.model_type
            why = (
                "its layers compute attention themselves, not through transformers' attention interface, which is "
                "what context parallelism replaces"
                if not calls
                else "context parallelism replaces its attention through transformers' attention interface"
            )
            raise UsageError(
                f"--cp_size: {family}'s forward fails once its attention is replaced ({type(e).__name__}: "
                f"{_first_line(e)}): {why}; train {family} without --cp_size (train_ddp.py, train_fsdp.py)"
            ) from None
        finally:
            model.config._attn_implementation = self.attn_implementation
            model.train(was_training)
        self._runs_with_attention_replaced.add(id(model))

    documents = None  # forward_at's, for the replaced attention during that call

    def forward_at(self, model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, documents=None):
        """Some tokens of each sequence at their real positions: the rotary embedding reads position_ids;
        `documents` (--document_mask: the whole sequences' ids) reach the replaced attention of every layer."""
        self.documents = documents
        try:
            return model(input_ids=input_ids, position_ids=positions.expand(input_ids.shape[0], -1))
        finally:
            self.documents = None

    def _model_with(self, state_dict: dict) -> nn.Module:
        from transformers import AutoModelForCausalLM

        config = copy.deepcopy(self.hf_config)
        config.use_cache = True  # the exported model is for inference: generate() wants its KV cache
        config._attn_implementation = self.attn_implementation  # not the ring a context-parallel run installed
        with torch.device("meta"):  # no init: every weight comes from the state dict
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        state_dict = {k: v.detach().to("cpu", torch.float32) for k, v in state_dict.items()}
        missing, unexpected = model.load_state_dict(state_dict, strict=False, assign=True)
        if config.tie_word_embeddings:
            model.tie_weights()  # lm_head is the embedding again (a state dict may hold it once or twice)
            missing = [k for k in missing if k != "lm_head.weight"]
        if missing or unexpected:
            raise RuntimeError(f"the state dict does not fit the model: missing {missing}, unexpected {unexpected}")
        return model  # the rotary inv_freq buffers stay on meta: not persistent, so neither saved nor needed
