#!/usr/bin/env python
"""Plan a layout before the job starts: will it fit, and which split (pipeline x data x tensor) is fastest?

For a model and a number of GPUs, every valid layout pp x dp_replicate x dp_shard x tp (or the
one you give) is costed the way the training scripts build it, without starting anything:

    per rank:  parameters + gradients + AdamW state    the shapes each rank holds after TP, PP and
                                                       FSDP cut the model (the same bytes as the
                                                       runs' state_bytes_per_rank_max; --cp_size:
                                                       FSDP over dp_shard x cp); --lora_r:
                                                       the frozen model's weights, and gradients
                                                       and AdamW state of the LoRA adapters only;
                                                       --optimizer muon: one fp32 momentum for
                                                       Muon's matrices, AdamW's state for the rest
             + activations                             what autograd keeps per micro-batch, times the
                                                       micro-batches the schedule holds in flight
             + gathered weights and gradients          FSDP's unsharded copies while a block computes
             = memory, against --gpu_memory_gib        fits, and by how much
    per step:  each collective's count and bytes, and the link it crosses:
                   ranks  0 1 2 3 4 5 6 7 | 8 9 ...    mesh dims pp -> dp_replicate -> dp_shard -> cp -> tp:
                          [ one node    ] | [ next     tp groups are consecutive ranks, so TP stays in a
                                                       node while tp <= --gpus_per_node; the outer
                                                       groups (FSDP, HSDP, PP) cross nodes once their
                                                       span exceeds one node
    step time: a plain roofline: FLOPs / peak, stretched by the pipeline bubble, plus TP and PP
               transfers (on the critical path) and the part of FSDP/HSDP traffic that computing
               cannot hide; bytes / bus bandwidth + latency per call, per link; --optimizer muon adds the
               gathers and scatters (or all-gathers) that make its cut matrices whole, after the backward,
               and the Newton–Schulz FLOPs of the matrices the rank orthogonalises, at the fp32 peak

Layouts that fit come first, fastest first. The tests check the plan against real runs: state
bytes within 1%, first-step collectives exactly, pipeline activations within 25%. Plan it:
    python scripts/plan_layout.py --model_size 1b --world_size 64 --mixed_precision bf16
    python scripts/plan_layout.py --model_size 1b --world_size 64 --pp_size 2 --dp_shard 4 --tp_size 8 --json
Defaults describe H100 SXM nodes of 8 GPUs (80 GB, NVLink inside a node, 400 Gb/s InfiniBand per
GPU between nodes); --network takes the links measured by scripts/preflight.py instead.
"""

import argparse
import itertools
import json
import math
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts run as files: make `common` importable

import torch
import torch.nn as nn

from common.cli import HelpFormatter
from common.context_parallel import cp_chunks, ring_steps
from common.costs import count_parameters
from common.errors import UsageError
from common.launch import run_main
from common.layout import DIMS, FLAGS, MESH_DIMS, Layout
from common.model import (
    GPT,
    GPTConfig,
    check_gpt_split,
    flops_per_token,
    gpt_config_from_args,
)
from common.muon import muon_matrices
from common.pipeline import MULTI_STAGE_SCHEDULES, SCHEDULES, stage_layers, stages_of_rank
from common.pp_checks import check_pipeline_layout
from common.pp_costs import bubble_theory
from common.presets import MODEL_PRESETS
from common.sharded_costs import ddp_state_bytes, ulysses_bytes_per_layer
from common.tp_costs import GPT_TP_CUTS

GiB = 2**30
MiB = 2**20
# Defaults: H100 SXM, dense peak FLOP/s, and all-reduce bus bandwidths (nccl-tests' busbw) per link
PEAK_TFLOPS = {"bf16": 989.0, "no": 67.0}  # bf16 tensor cores; plain fp32 (the scripts' default precision)
DEFAULT_LINKS = {
    "intra_node": {"bandwidth_GBps": 360.0, "latency_us": 10.0},  # NVLink 4 / NVSwitch, 8 GPUs
    "inter_node": {"bandwidth_GBps": 40.0, "latency_us": 25.0},  # 400 Gb/s InfiniBand per GPU
}
PREFLIGHT_FORMAT = "preflight/1"


# ======================================== what each rank holds
def model_parameters(
    cfg: GPTConfig, lora_r: int | None = None, lora_targets: str | None = None
) -> tuple[list[dict], int]:
    """Name, shape and TP placement of every parameter, read from the real model built on the meta
    device (no memory) and the cuts of train_tp.py's plan (common/tp_costs.py's GPT_TP_CUTS, which a test
    holds to the plan). `tp_dim`: the dimension TP splits (None: replicated on every TP rank); `muon`: a
    matrix --optimizer muon gives Muon (common/muon.py's muon_matrices). With `lora_r`: the model frozen and
    LoRA's adapters beside it (lora_parameters)."""
    with torch.device("meta"):
        model = GPT(cfg)
    muon = {id(p) for p in muon_matrices(model)}  # --optimizer muon: its matrices (common/muon.py's choice)
    params = []
    for module_name, module in model.named_modules():
        cut = GPT_TP_CUTS.get(module_name.rsplit(".", 1)[-1])
        for short, p in module.named_parameters(recurse=False):
            tp_dim = None
            if cut == "colwise":  # Linear: output rows (weight and bias); Embedding: columns
                tp_dim = 1 if isinstance(module, nn.Embedding) else 0
            elif cut == "rowwise" and short == "weight":  # Linear: input columns; Embedding: rows
                tp_dim = 0 if isinstance(module, nn.Embedding) else 1
            block = int(module_name.split(".")[1]) if module_name.startswith("blocks.") else None
            top = module_name.split(".")[0]
            end = "first" if top in ("tok_emb", "pos_emb") else "last" if top in ("ln_f", "lm_head") else None
            params.append(
                {
                    "name": f"{module_name}.{short}",
                    "shape": tuple(p.shape),
                    "tp_dim": tp_dim,
                    "block": block,
                    "end": end,
                    "muon": id(p) in muon,
                }
            )
    if lora_r:
        return lora_parameters(model, params, lora_r, lora_targets)
    return params, count_parameters(model)


def lora_parameters(model: nn.Module, params: list[dict], r: int, spec: str | None) -> tuple[list[dict], int]:
    """LoRA (--lora_r), as common/lora.py's apply_lora and lora_tp_plan build it, on the meta model's shapes:
    the model's own parameters frozen (`trains` False: weights only, no gradient, no optimizer state), and
    beside each targeted nn.Linear (--lora_target_modules, else every *proj; never the output head) its two
    adapters in nn.Linear's weight layout, trained: A (r, in) and B (out, r). TP cuts them to follow their
    layer: beside a column-wise one A whole and B's rows (its outputs, as the layer's), beside a row-wise one
    A's columns (its inputs) and B whole; FSDP shards them like every parameter; PP keeps them in their block.
    `tp_all_reduce`: the rank-r all-reduce that cut adds per micro-batch, of the row-wise layer's A output in
    forward (partial sums), of the column-wise layer's B input gradient in backward. `sublayer`: the position,
    in its block, of the module holding the layer (attention 0, MLP 1): where gradients start to flow.
    Returns the parameters and their count, adapters included (the runs' n_params)."""
    from common.lora import default_targets  # the scripts' own default: every *proj

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head}
    known = list(dict.fromkeys(n.rsplit(".", 1)[-1] for n in linears))
    if spec is not None:  # the scripts' checks and lines (common/lora.py's apply_lora)
        targets = [t.strip() for t in spec.split(",") if t.strip()]
        unknown = [t for t in targets if t not in known]
        if unknown or not targets:
            raise UsageError(
                f"--lora_target_modules {spec}: {', '.join(unknown) or 'no name'} names no linear layer of this "
                f"model (its linear layers: {', '.join(known) or 'none'})"
            )
        head_name = next((n for n, m in model.named_modules() if m is head), None) if head is not None else None
        if head_name is not None and head_name.rsplit(".", 1)[-1] in targets:
            raise UsageError("--lora_target_modules: the output head takes no adapter here; name hidden layers only")
    else:
        targets = default_targets(model)

    def sublayer(name: str) -> str:  # the module under the block that holds the layer (attn, mlp, self_attn)
        parts = name.split(".")
        i = next((i for i, part in enumerate(parts) if part.isdigit()), len(parts) - 2)
        return ".".join(parts[: i + 2])

    order: dict[str, int] = {}  # each block's sublayers in forward order (the module tree's)
    for name in linears:
        block = sublayer(name).rsplit(".", 1)[0]
        order.setdefault(sublayer(name), sum(s.rsplit(".", 1)[0] == block for s in order))
    lora, n_adapters = [], 0
    for p in params:
        lora.append(p | {"trains": False, "muon": False})  # frozen: Muon takes the adapters only
        module_name, short = p["name"].rsplit(".", 1)
        if short != "weight" or module_name not in linears or module_name.rsplit(".", 1)[-1] not in targets:
            continue
        layer = linears[module_name]
        cut = {0: "column", 1: "row"}.get(p["tp_dim"])  # of the base's [out, in] weight
        where = {"block": p["block"], "end": p["end"], "trains": True, "muon": True}  # 2-D and trained: Muon's
        where["sublayer"] = order[sublayer(module_name)]
        floor = {"tp_floor": p["tp_floor"]} if "tp_floor" in p else {}  # B's rows are the layer's outputs
        lora.append(
            {"name": f"{module_name}.lora_A.default.weight", "shape": (r, layer.in_features)}
            | {"tp_dim": 1 if cut == "row" else None, "tp_all_reduce": "forward" if cut == "row" else None}
            | where
        )
        lora.append(
            {"name": f"{module_name}.lora_B.default.weight", "shape": (layer.out_features, r)}
            | {"tp_dim": 0 if cut == "column" else None, "tp_all_reduce": "backward" if cut == "column" else None}
            | where
            | floor
        )
        n_adapters += r * (layer.in_features + layer.out_features)
    return lora, count_parameters(model) + n_adapters


def split_shape(shape: tuple, tp: int, tp_dim: int | None, floor: int | None = None) -> tuple:
    """The piece one TP rank holds; `floor`: the smallest piece (one KV head's rows: KV heads fewer than
    tp are replicated over the ranks that share them)."""
    if tp_dim is None or tp == 1:
        return shape
    return tuple(max(n // tp, floor or 0) if i == tp_dim else n for i, n in enumerate(shape))


def fsdp_rows(rows: int, shards: int) -> tuple[int, int]:
    """(rows of the largest shard, rows after padding): fully_shard chunks dim 0 like torch.chunk
    (rank 0 gets the largest piece) and pads it to `shards` equal pieces for its collectives."""
    largest = math.ceil(rows / shards)
    return largest, largest * shards


def fsdp_group(layout: Layout) -> tuple[str, int]:
    """(FSDP's group, its ranks): dp_shard; under CP dp_shard_cp, dp_shard x cp flattened (common/layout.py's
    Layout.fsdp_mesh, torchtitan's dp_shard_cp): the CP ranks of a data-parallel rank hold the same weights,
    so FSDP shards them over those ranks too. HSDP replicates the shards over dp_replicate."""
    if layout.cp > 1:
        return "dp_shard_cp", layout.dp_shard * layout.cp
    return "dp_shard", layout.dp_shard


def kv_copied(p: dict, tp: int) -> bool:
    """KV heads fewer than tp: the parameter is copied over the ranks that share a head (common/hf_tp.py's
    KVHeadsReplicated: a DTensor of its own mesh, Shard(0) over the heads, Replicate() over the copies)."""
    return bool(tp > 1 and p.get("tp_floor") and p["shape"][p["tp_dim"]] // tp < p["tp_floor"])


def muon_cuts(p: dict, layout: Layout) -> list[tuple[str, int]]:
    """The mesh dimensions (group, ranks) that cut a matrix of `p` (common/muon.py's cutting_dims), in the
    order DTensor's full_tensor all-gathers them: TP's dimension (or, KV heads copied, the heads'), and FSDP's
    rows (dim 0, which cuts a matrix, not a stack's 3-D one; over dp_shard, or dp_shard_cp under CP:
    fsdp_group). Both cut: FSDP's first where TP cuts the same rows (a strided shard), else TP's first."""
    ndim, cuts = len(p["shape"]), []
    if layout.tp > 1 and p["tp_dim"] is not None and p["tp_dim"] % ndim >= ndim - 2:
        heads = p["shape"][p["tp_dim"]] // p["tp_floor"] if kv_copied(p, layout.tp) else layout.tp
        cuts += [("tp", heads)] if heads > 1 else []
    group, shards = fsdp_group(layout)
    if shards > 1 and ndim == 2:
        cuts.insert(0 if p["tp_dim"] == 0 else len(cuts), (group, shards))
    return cuts


class RankState:
    """The parameters one pipeline rank holds (tp, cp and dp rank 0: the largest shards), grouped
    into FSDP units: one per block, plus the stage's root (embeddings, final norm, head). Each unit counts
    what it holds and, apart, what of it trains (`trained_*`: all of it, but under LoRA the adapters only).
    `lora_tp`: under LoRA, the rank-r all-reduces TP adds per micro-batch (`forward`, `backward`, of `r`
    values a token) and `frozen_sublayers`, the sublayers (two a block) on the first stage before the first
    adapter and its own, whose input needs no gradient: TP's backward all-reduce there does not run.
    `matrices`: Muon's matrices on this rank, in the order the optimizer deals them (muon_traffic)."""

    def __init__(self, params: list[dict], layout: Layout, pp_rank: int, stages_per_rank: int, n_layer: int):
        n_stages = layout.pp * stages_per_rank
        layers = stage_layers(n_layer, n_stages)
        self.stages = stages_of_rank(pp_rank, layout.pp, stages_per_rank)
        self.layers = [i for s in self.stages for i in layers[s]]
        self.has_first, self.has_last = 0 in self.stages, n_stages - 1 in self.stages
        keep_root = ({"first"} if self.has_first else set()) | ({"last"} if self.has_last else set())
        self.units: dict[str, dict] = {}  # unit -> numel held, numel padded (all-gather size), tensors
        self.lora_tp = {"forward": 0, "backward": 0, "r": 0, "frozen_sublayers": 0}
        first_layers = layers[0] if self.has_first else []
        first_adapter = (math.inf, 0)  # (layer, sublayer) of the first adapter on the first stage
        self.matrices, placements = [], []  # Muon's matrices; the optimizer's groups of matrices, in their order
        for p in params:
            if p["block"] is not None:
                if p["block"] not in self.layers:
                    continue
                unit = f"block {p['block']}"
            elif p["end"] in keep_root:  # embeddings on the first stage, final norm and head on the last
                unit = "root"
            else:
                continue
            shape = split_shape(p["shape"], layout.tp, p["tp_dim"], p.get("tp_floor"))
            rest = math.prod(shape[1:])
            held, padded = fsdp_rows(shape[0], fsdp_group(layout)[1])  # FSDP: over dp_shard (x cp)
            u = self.units.setdefault(unit, dict.fromkeys(("held", "padded", "full", "tensors"), 0))
            trains, muon = p.get("trains", True), p.get("trains", True) and p.get("muon", False)
            for prefix in [""] + ["trained_"] * trains + ["muon_"] * muon:  # muon_: Muon's matrices
                u[f"{prefix}held"] = u.get(f"{prefix}held", 0) + held * rest
                u[f"{prefix}padded"] = u.get(f"{prefix}padded", 0) + padded * rest
                u[f"{prefix}full"] = u.get(f"{prefix}full", 0) + math.prod(shape)
                u[f"{prefix}tensors"] = u.get(f"{prefix}tensors", 0) + 1
            if trains and len(shape) >= 2:  # make_optimizer's groups of matrices: one per DTensor placement
                placement = (p["tp_dim"] if layout.tp > 1 else None, kv_copied(p, layout.tp))
                placements += [placement] if placement not in placements else []
                if muon:
                    self.matrices.append(
                        {"param_group": placements.index(placement), "cuts": muon_cuts(p, layout)}
                        | {"local": held * rest, "whole": math.prod(p["shape"])}  # rank 0's slice, the matrix
                        | {"shape": p["shape"]}  # what Newton–Schulz orthogonalises: the whole matrix
                    )
            if p.get("tp_all_reduce"):
                self.lora_tp[p["tp_all_reduce"]] += 1
                self.lora_tp["r"] = p["shape"][0] if p["tp_all_reduce"] == "forward" else p["shape"][1]
            if "sublayer" in p and p["block"] in first_layers:
                first_adapter = min(first_adapter, (first_layers.index(p["block"]), p["sublayer"]))
        if first_layers and any("sublayer" in p for p in params):  # LoRA: nothing before the first adapter trains
            layer, sublayer = first_adapter
            self.lora_tp["frozen_sublayers"] = min(2 * len(first_layers), 2 * layer + sublayer + 1)

    def state_bytes(self, optimizer: str) -> dict:
        """fp32 parameters, gradients and (AdamW) two moments plus a 4-byte step count per tensor:
        the scripts keep fp32 master weights under bf16 too. Gradients and optimizer state: of what trains
        (LoRA: the adapters; the frozen base counts in the parameters only). Muon: one momentum for its
        matrices (no step count), laid out as each parameter; AdamW's two moments and step for the rest."""
        held = sum(u["held"] for u in self.units.values())
        trained = sum(u.get("trained_held", 0) for u in self.units.values())
        tensors = sum(u.get("trained_tensors", 0) for u in self.units.values())
        muon = sum(u.get("muon_held", 0) for u in self.units.values()) if optimizer == "muon" else 0
        muon_tensors = sum(u.get("muon_tensors", 0) for u in self.units.values()) if optimizer == "muon" else 0
        optim = 4 * muon + 8 * (trained - muon) + 4 * (tensors - muon_tensors) if optimizer != "sgd" else 0
        figures = {"param_bytes": 4 * held, "grad_bytes": 4 * trained, "optimizer_bytes": optim}
        figures["total_bytes"] = sum(figures.values())
        return figures

    def full_numel(self, trained: bool = False) -> int:
        """This rank's parameters gathered over FSDP's group (still split by TP); `trained`: those that train."""
        return sum(u.get("trained_full" if trained else "full", 0) for u in self.units.values())


# ======================================== a 🤗 model's config (--model_config)
# transformers' TP style names (config.base_model_tp_plan) -> the dimension of a weight that TP cuts:
# column-wise styles cut the output features (dim -2 of a Linear's [out, in] weight or of packed experts'
# [E, out, in], and the bias), row-wise styles the input features (dim -1; the bias stays whole), a
# vocabulary-parallel embedding its rows. Replicated norms and the experts module itself hold no cut.
COLUMN_STYLES = ("colwise", "colwise_gather_output", "packed_colwise")
ROW_STYLES = ("rowwise", "rowwise_split_input", "packed_rowwise")
EMBEDDING_STYLES = ("embedding_rowwise",)
KV_PROJECTIONS = ("k_proj", "v_proj")  # common/hf_tp.py's: copied over the TP ranks where fewer KV heads than tp
EXPERT_COUNT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")  # Mixtral/gpt-oss, Qwen-MoE, DeepSeek


def tp_dim_of(style: str | None, ndim: int) -> int | None:
    if style in EMBEDDING_STYLES:
        return 0
    if style in COLUMN_STYLES:
        return ndim - 2 if ndim >= 2 else 0
    if style in ROW_STYLES and ndim >= 2:
        return ndim - 1
    return None


class HFShape:
    """A 🤗 causal LM read from its config and built on the meta device (no memory), as the training
    scripts build it from --model_config: fp32, untied embeddings, the byte vocabulary (--vocab_size).
    It stands where the built-in GPT's GPTConfig stands (n_layer, n_embd, n_head, vocab_size,
    block_size) and lists its parameters as the planner cuts them:
    - TP: the columns / rows of the family's base_model_tp_plan, plus what the scripts add to it, a
      vocabulary-parallel embedding and a column-wise head (loss parallel); KV heads fewer than tp are
      replicated over the ranks that share them;
    - PP: stages of decoder layers, the embedding on the first, the final norm and head on the last;
    - EP: the experts' batched weights (`.experts.` in the name) cut over ep;
    - FSDP: everything, each decoder layer a unit, the rest the root."""

    def __init__(
        self, spec: str, vocab_size: int, block_size: int | None, lora_r: int | None = None, lora_targets=None
    ):
        from transformers import AutoModelForCausalLM

        from common.hf import check_causal_lm, find_units_path, read_config

        config, source = read_config(spec, block_size)
        check_causal_lm(config, f"--model_config {spec}")
        if vocab_size:  # the scripts train --model_config models on bytes: 256 ids
            config.vocab_size = vocab_size
            config.pad_token_id = config.bos_token_id = config.eos_token_id = None
        config.tie_word_embeddings = False  # untied, as the scripts build it (TP and PP cut the two apart)
        config.use_cache = False
        try:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
        except (ValueError, TypeError) as e:
            raise UsageError(f"--model_config {spec}: {str(e).strip().splitlines()[0]}") from None
        self.model_type, self.source = config.model_type, source
        self.units_path = find_units_path(model, f"--model_config {spec}")
        self.n_layer = len(model.get_submodule(self.units_path))
        self.n_embd = config.hidden_size
        self.n_head = config.num_attention_heads
        self.n_kv_head = getattr(config, "num_key_value_heads", None) or self.n_head
        self.head_dim = getattr(config, "head_dim", None) or self.n_embd // self.n_head
        self.vocab_size = config.vocab_size
        self.block_size = block_size or getattr(config, "max_position_embeddings", None) or 1024
        self.n_experts = next((getattr(config, f) for f in EXPERT_COUNT_FIELDS if getattr(config, f, None)), 0)
        self.top_k = getattr(config, "num_experts_per_tok", 0) or 0
        self.params, self.n_params = self._parameters(model, config)
        names = [p["name"] for p in self.params if p["block"] == 0]
        self.gated = any("gate" in n.rsplit(".", 2)[-2] for n in names)  # SwiGLU / GeGLU: gate_proj, gate_up_proj
        self.intermediate = config.intermediate_size
        self.moe_layers = sorted({p["block"] for p in self.params if ".experts." in p["name"]})
        self.lora_kv = False  # LoRA on k_proj / v_proj: TP cannot copy KV heads (fewer than tp) with adapters
        if lora_r:
            if self.n_experts:
                raise UsageError(
                    f"--lora_r: --model_config {spec} is a mixture of experts, planned as train_ep.py's layouts, "
                    "which count no LoRA adapters: plan it without --lora_r"
                )
            self.params, self.n_params = lora_parameters(model, self.params, lora_r, lora_targets)
            self.lora_kv = any(p.get("trains") and p["name"].split(".")[-4] in KV_PROJECTIONS for p in self.params)

    def _parameters(self, model: nn.Module, config) -> tuple[list[dict], int]:
        prefix = model.base_model_prefix
        plan = dict(getattr(config, "base_model_tp_plan", None) or {})
        patterns = [(re.compile(re.escape(k).replace(r"\*", r"\d+") + "$"), v) for k, v in plan.items()]
        order = list(getattr(config, "base_model_pp_plan", None) or {})  # embedding, layers, final norm
        layers_name = self.units_path.split(".")[-1]
        embedding = model.get_input_embeddings()
        head = model.get_output_embeddings()
        muon = {id(p) for p in muon_matrices(model)}
        params = []
        for module_name, module in model.named_modules():
            for short, p in module.named_parameters(recurse=False):
                name = f"{module_name}.{short}"
                inner = module_name.removeprefix(f"{prefix}.")
                style = next((v for r, v in patterns if r.match(inner) or r.match(f"{inner}.{short}")), None)
                if module is embedding:
                    style = "embedding_rowwise"  # the scripts' vocabulary-parallel embedding
                elif module is head:
                    style = "colwise"  # loss parallel: the logits stay cut over the vocabulary
                tp_dim = tp_dim_of(style, p.ndim) if not (short == "bias" and style in ROW_STYLES) else None
                block, end = None, None
                if name.startswith(f"{self.units_path}."):
                    block = int(name[len(self.units_path) + 1 :].split(".")[0])
                else:  # outside the layers: before them in the pp plan -> first stage, else the last
                    top = inner.split(".")[0]
                    if module is embedding or (top in order and order.index(top) < order.index(layers_name)):
                        end = "first"
                    else:
                        end = "last"
                floor = None  # KV heads fewer than tp: each rank keeps one whole KV head (replicated)
                if tp_dim == 0 and module_name.rsplit(".", 1)[-1] in ("k_proj", "v_proj"):
                    floor = self.head_dim
                params.append(
                    {"name": name, "shape": tuple(p.shape), "tp_dim": tp_dim, "block": block, "end": end}
                    | {"muon": id(p) in muon}
                    | ({"tp_floor": floor} if floor else {})
                )
        return params, count_parameters(model)

    def check_split(self, tp: int, n_stages: int, stages_per_rank: int) -> None:
        """What the cuts must divide (one line each): TP the query heads, the KV heads (or tp a multiple
        of them: replicated, but not with LoRA adapters on them), the MLP width, the vocabulary; a pipeline
        a decoder layer per stage."""
        if tp > 1 and self.lora_kv and self.n_kv_head % tp:  # common/lora.py's lora_tp_plan refuses the copies
            raise UsageError(
                f"--lora_r: --tp_size {tp} copies the model's {self.n_kv_head} KV heads over the ranks, which an "
                "adapter does not follow: leave k_proj and v_proj out of --lora_target_modules, or a --tp_size that "
                "divides the KV heads"
            )
        if tp > 1:
            for what, size in (
                ("query heads (num_attention_heads)", self.n_head),
                ("MLP columns (intermediate_size)", self.intermediate),
                ("vocabulary rows (--vocab_size)", self.vocab_size),
            ):
                if size % tp:
                    raise UsageError(f"--tp_size {tp} does not divide the model's {size} {what}")
            if self.n_kv_head % tp and tp % self.n_kv_head:
                raise UsageError(
                    f"--tp_size {tp} neither divides the model's {self.n_kv_head} KV heads nor is a multiple of "
                    "them (to replicate each over tp / kv ranks): use a --tp_size that does one of the two"
                )
        if n_stages > self.n_layer:
            raise UsageError(
                f"--pp_size {n_stages // stages_per_rank} x --stages_per_rank {stages_per_rank} = {n_stages} stages, "
                f"but the model has {self.n_layer} decoder layers: every stage needs at least one"
            )

    def layer_activation_bytes(self, tokens: int, tp: int, bf16: bool) -> int:
        """The GPT planner's count for a 🤗 decoder layer: the residual stream x and x + attn (fp32), the two
        norms' outputs, q (heads / tp), k and v (KV heads / tp, at least one), the attention output; the
        MLP's saved tensors (gated: gate, up, act(gate), their product; plain: its input and activation,
        intermediate / tp wide); the norms' rstd and attention's log-sum-exp (fp32, small)."""
        low = 2 if bf16 else 4
        q_heads, kv_heads = self.n_head // tp, max(self.n_kv_head // tp, 1)
        residual = 2 * tokens * self.n_embd * 4
        norm_outputs = 2 * tokens * self.n_embd * low
        attention = tokens * self.head_dim * (2 * q_heads + 2 * kv_heads) * low
        mlp = tokens * (self.intermediate // tp) * (4 if self.gated else 2) * low
        small = (2 * tokens + tokens * q_heads) * 4
        return residual + norm_outputs + attention + mlp + small

    def describe(self) -> str:
        return (
            f"{self.model_type} ({self.source}, vocabulary {self.vocab_size}), {self.n_params / 1e9:.3f}B parameters "
            f"({self.n_layer} layers x {self.n_embd} wide, {self.n_head} heads, {self.n_kv_head} KV heads)"
        )


# ======================================== activations
def block_activation_bytes(cfg: GPTConfig, micro_batch: int, seq_len: int, tp: int, bf16: bool) -> int:
    """What autograd keeps for one block and one micro-batch (measured with saved-tensor hooks):
    the residual stream x and x + attn (fp32 under autocast too), the two LayerNorm outputs, q, k,
    v, the attention output, the MLP's 4d-wide input and GELU output; plus LayerNorm mean and rstd
    and attention's log-sum-exp (fp32, small). TP splits everything but the residual stream and
    the norms' outputs (no sequence parallel); SDPA's fused kernels keep no T x T matrix."""
    if isinstance(cfg, HFShape):
        return cfg.layer_activation_bytes(micro_batch * seq_len, tp, bf16)
    tokens, d = micro_batch * seq_len, cfg.n_embd
    low = 2 if bf16 else 4  # bytes of a tensor that autocast computes in bf16
    residual = 2 * tokens * d * 4
    norm_outputs = 2 * tokens * d * low
    split = (4 * tokens * d + 8 * tokens * d) * low // tp  # q, k, v, attention out; MLP in and GELU out
    small = (4 * tokens + tokens * cfg.n_head // tp) * 4
    return residual + norm_outputs + split + small


def stage_activation_bytes(
    cfg: GPTConfig, rank: RankState, micro_batch: int, seq_len: int, tp: int, bf16: bool, checkpointing: bool
) -> dict:
    """Per micro-batch on this pipeline rank: its blocks (or only their inputs, with activation
    checkpointing), the token ids the embedding keeps, the final norm's input and output, and the
    stage's output tensor, which the pipeline keeps until that micro-batch's backward."""
    tokens, d = micro_batch * seq_len, cfg.n_embd
    block = block_activation_bytes(cfg, micro_batch, seq_len, tp, bf16)
    per_block = tokens * d * 4 if checkpointing else block
    kept = len(rank.layers) * per_block
    if rank.has_first:
        kept += tokens * 8 + seq_len * 8  # int64 token ids and positions
    if rank.has_last:
        kept += 2 * tokens * d * 4 + 2 * tokens * 4  # ln_f input and output, mean, rstd
    else:
        kept += tokens * d * 4  # the output sent to the next stage, held until its gradient returns
    recompute = block if checkpointing and rank.layers else 0  # one block's activations, rebuilt in backward
    # logits (vocab-wide, gathered under TP) and the loss's fp32 copy and log-softmax: one micro-batch at a time
    logits = tokens * cfg.vocab_size * ((2 if bf16 else 4) + 8) if rank.has_last else 0
    return {"per_microbatch": kept, "recompute": recompute, "logits": logits}


def microbatches_in_flight(schedule: str, pp: int, pp_rank: int, n_microbatches: int, stages_per_rank: int) -> int:
    """Micro-batches whose activations one stage of this rank holds at once. GPipe: all of them;
    1F1B: pp - rank (stage 0 holds most); the interleaved schedules warm up with
    (v-1) * pp + 2 * (pp - 1 - rank) forwards before the first backward (torch's formula), counted
    in stages of 1/v the size."""
    if pp == 1:
        return 1
    if schedule == "gpipe":
        return n_microbatches
    if schedule == "1f1b":
        return min(pp - pp_rank, n_microbatches)
    warmup = (stages_per_rank - 1) * pp + 2 * (pp - 1 - pp_rank)
    return min(warmup + 1, n_microbatches * stages_per_rank)


# ======================================== the order of forwards and backwards, and FSDP's all-gathers
def rank_order(schedule: str, pp: int, pp_rank: int, n_microbatches: int) -> list[tuple[str, int]]:
    """Forward and backward of each micro-batch on one stage, in schedule order (one stage per rank)."""
    m = n_microbatches
    if schedule == "gpipe" or pp == 1:
        if pp == 1:  # no pipeline: gradient accumulation, forward then backward per micro-batch
            return [a for i in range(m) for a in (("F", i), ("B", i))]
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(pp - 1 - pp_rank, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(m - warmup, m)]


def fsdp_all_gathers(
    schedule: str, layout: Layout, pp_rank: int, n_microbatches: int, reshard_after_forward: bool
) -> int:
    """All-gathers of one FSDP unit per step. Each forward gathers the unit's weights unless they
    are already gathered. A block's are freed after its forward (reshard after forward), so without
    a pipeline its backward gathers them again; a root's stay gathered into backward, and so do
    every unit's under a pipeline (the scripts pass reshard_after_forward=False there). Inside a
    pipeline torch also keeps them gathered from one backward to the next until the last."""
    gathered, count = False, 0
    for action, _ in rank_order(schedule, layout.pp, pp_rank, n_microbatches):
        if not gathered:
            count += 1
        if action == "F":  # freed after a forward only when resharding
            gathered = not reshard_after_forward
        else:  # after a backward: kept inside a pipeline, freed without one
            gathered = layout.pp > 1
    return count


# ======================================== collectives
def group_dims(group: str) -> list[str]:
    """The mesh dimensions a group spans: one (tp, dp_shard, ...), or adjacent ones flattened into one group,
    named as DeviceMesh._flatten names it, their names joined: dp_shard_cp (FSDP under CP), dp_shard_tp and
    dp_shard_cp_tp (Muon's matrices cut by FSDP and TP)."""
    dims, rest = [], group
    while rest:
        dim = next(d for d in MESH_DIMS if rest == d or rest.startswith(f"{d}_"))
        dims.append(dim)
        rest = rest[len(dim) + 1 :]
    return dims


def group_span(layout: Layout, group: str) -> tuple[int, int]:
    """(stride between the ranks of one group, group size): the mesh is pp -> dp_replicate -> dp_shard ->
    cp -> tp (common/layout.py's MESH_DIMS), tp innermost; a flattened group's dims are adjacent."""
    dims = group_dims(group)
    inner = MESH_DIMS[MESH_DIMS.index(dims[-1]) + 1 :]
    return math.prod(getattr(layout, d) for d in inner), math.prod(getattr(layout, d) for d in dims)


def link_of(layout: Layout, dim: str, gpus_per_node: int) -> str:
    """intra_node when every group of `dim` (a mesh dimension, or adjacent ones flattened) lies inside one
    node: its span (stride x size) tiles a node."""
    stride, size = group_span(layout, dim)
    span = stride * (size - 1) + 1
    return "intra_node" if span <= gpus_per_node and gpus_per_node % (stride * size) == 0 else "inter_node"


class Traffic:
    """Collectives of one rank and one step: (group, kind) -> calls, bytes."""

    def __init__(self):
        self.items: dict[tuple[str, str], list] = {}

    def add(self, group: str, kind: str, calls: int, nbytes: float) -> None:
        if calls:
            item = self.items.setdefault((group, kind), [0, 0.0])
            item[0] += calls
            item[1] += calls * nbytes

    def merged(self, other: "Traffic") -> "Traffic":
        total = Traffic()
        for source in (self, other):
            for (group, kind), (calls, nbytes) in source.items.items():
                total.add(group, kind, calls, nbytes / calls)
        return total

    def by_kind(self) -> dict:
        """In the format of the runs' collectives_first_step_rank0: {kind: {calls, mib}}."""
        kinds: dict[str, list] = {}
        for (_, kind), (calls, nbytes) in self.items.items():
            k = kinds.setdefault(kind, [0, 0.0])
            k[0] += calls
            k[1] += nbytes
        return {k: {"calls": c, "mib": round(b / MiB, 4)} for k, (c, b) in sorted(kinds.items())}


def forward_tp_traffic(traffic: Traffic, cfg: GPTConfig, rank: RankState, tokens: int, bf16: bool) -> None:
    """Forward of one micro-batch under TP: the embedding's partial sums (fp32), one all-reduce after
    attention and one after the MLP per block (Megatron's g), the logits all-gathered at the head; under
    LoRA, each row-wise layer's adapter A sums its rank-r partial output too."""
    act = 2 if bf16 else 4
    if rank.has_first:
        traffic.add("tp", "all_reduce", 1, tokens * cfg.n_embd * 4)
    traffic.add("tp", "all_reduce", 2 * len(rank.layers), tokens * cfg.n_embd * act)
    traffic.add("tp", "all_reduce", rank.lora_tp["forward"], tokens * rank.lora_tp["r"] * act)
    if rank.has_last:
        traffic.add("tp", "all_gather", 1, tokens * cfg.vocab_size * act)


def rank_traffic(cfg, layout: Layout, rank: RankState, pp_rank: int, args, bf16: bool) -> tuple[Traffic, Traffic]:
    """(every step, the first step's extra) for one rank of pipeline position `pp_rank`. Under CP the rank holds
    seq_len / cp tokens of each sequence: TP's and PP's tensors are theirs; FSDP works over dp_shard x cp."""
    m = args.n_microbatches
    micro_batch = args.batch_size // m
    tokens = micro_batch * args.seq_len // layout.cp
    act = 2 if bf16 else 4
    step, first = Traffic(), Traffic()
    if layout.tp > 1:
        for _ in range(m):
            forward_tp_traffic(step, cfg, rank, tokens, bf16)
        # backward (Megatron's f): the input gradient of attention and MLP per block, of the head. Under LoRA
        # none where the input needs no gradient (the first stage's sublayers up to the first adapter's), and
        # each column-wise layer's adapter B sums its rank-r input gradient (A's weight gradient needs it)
        frozen = rank.lora_tp["frozen_sublayers"]
        step.add("tp", "all_reduce", m * (2 * len(rank.layers) - frozen), tokens * cfg.n_embd * act)
        step.add("tp", "all_reduce", m * rank.has_last, tokens * cfg.n_embd * act)
        step.add("tp", "all_reduce", m * rank.lora_tp["backward"], tokens * rank.lora_tp["r"] * act)
    group, shards = fsdp_group(layout)  # FSDP's: dp_shard, or under CP dp_shard_cp
    if layout.dp * layout.cp > 1:  # what Layout.fsdp_mesh shards over: data-parallel or CP ranks
        param_bytes = 2 if bf16 else 4  # FSDP gathers in the compute dtype and reduces in fp32
        for name, unit in rank.units.items():
            reshard = layout.pp == 1 and name != "root"  # what the scripts pass to fully_shard
            gathers = fsdp_all_gathers(args.schedule, layout, pp_rank, m, reshard)
            # gradient accumulation (no pipeline): a reduce-scatter per micro-batch, as train_fsdp.py does by
            # default; --unsharded_accumulation and a pipeline's schedule: once, after the last backward
            reductions = 1 if layout.pp > 1 or args.unsharded_accumulation else m
            # the gradients of what trains (LoRA: the adapters'; a unit with none, none at all)
            reductions *= bool(unit.get("trained_tensors"))
            trained = unit.get("trained_padded", 0)
            if shards > 1:  # each stage of this rank has its own root: one gather each
                calls = gathers * (len(rank.stages) if name == "root" else 1)
                step.add(group, "all_gather", calls, unit["padded"] * param_bytes * gathers / calls)
                step.add(group, "reduce_scatter", reductions, trained * 4)
            if layout.dp_replicate > 1:  # HSDP: the shards' gradients averaged over the replicas
                step.add("dp_replicate", "all_reduce", reductions, trained // shards * 4)
    if layout.pp > 1:
        boundary = tokens * cfg.n_embd * 4  # the residual stream crosses stages, fp32 under autocast too
        n_stages = layout.pp * args.stages_per_rank
        for s in rank.stages:  # looped placement: a stage's neighbours are always on other ranks
            if s < n_stages - 1:  # activations to the next stage, their gradients back
                step.add("pp", "send", m, boundary)
                step.add("pp", "recv", m, boundary)
            if s > 0:  # activations from the previous stage, their gradients to it
                step.add("pp", "recv", m, boundary)
                step.add("pp", "send", m, boundary)
        # The pipeline's first call: the stages agree on shapes (a vote, then metadata each way: 3 sends and
        # 3 receives of a few hundred bytes for stage 0) and run one real forward to learn them. That is the
        # cut check's probe step, before step 1, unless --skip_cut_check makes it the run's first step.
        if rank.has_first and args.stages_per_rank == 1 and getattr(args, "skip_cut_check", False):
            first.add("pp", "send", 3, 0)
            first.add("pp", "recv", 3, 0)
            if layout.tp > 1:
                forward_tp_traffic(first, cfg, rank, tokens, bf16)
            if shards > 1:
                for unit in rank.units.values():
                    first.add(group, "all_gather", 1, unit["padded"] * (2 if bf16 else 4))
    return step, first


def newton_schulz_flops(shape: tuple, steps: int) -> int:
    """FLOPs of common/muon.py's newton_schulz on one update of `shape` (a matrix, or a stack of them in its last
    two dimensions), its matrix products as torch.utils.flop_counter counts them (2 per multiply-add). X is taken
    short side first, A x B with A <= B; each of the `steps` iterations runs gram = X Xᵀ (2·A·A·B), the
    polynomial addmm(G, G, G) = bG + cG² (2·A³) and addmm(X, ·, X) = aX + (bG + cG²)X (2·A·A·B); baddbmm does
    the same for each matrix of a stack. Left out, as the counter leaves it: the elementwise work (the
    normalisation, a norm and a division of the A·B values, once; the addmms' scalings and adds), about 1/A of
    the products' FLOPs: under 2% for a matrix of 64 rows or more (a router of 4 rows: a quarter)."""
    *stack, rows, cols = shape
    short, long = min(rows, cols), max(rows, cols)
    return math.prod(stack) * steps * (4 * short * short * long + 2 * short**3)


def flattened(cuts: list[tuple[str, int]]) -> tuple[str, int]:
    """common/muon.py's flattened_group for a matrix cut along two mesh dimensions (FSDP's and TP's): one group
    over both, named as DeviceMesh._flatten names it, the cuts' groups in mesh order (TP innermost) joined:
    dp_shard_tp, or under CP dp_shard_cp_tp; its ranks, the product of the two cuts'."""
    names = sorted((group for group, _ in cuts), key=lambda group: group == "tp")
    return "_".join(names), math.prod(n for _, n in cuts)


def muon_traffic(matrices: list[dict], ns_steps: int, replicas: int = 1) -> tuple[Traffic, dict]:
    """--optimizer muon: what one optimizer step sends to make this rank's cut matrices whole for Newton–Schulz
    (common/muon.py's orthogonalise_all), for the rank whose group ranks are all 0 (the plan's rank), the
    figures of the run's `optimizer:` start line, and the Newton–Schulz FLOPs that rank computes. `matrices`:
    RankState.matrices (or ep_rank_state's), each with its cuts, rank 0's slice (`local`), what a gather makes
    whole (`whole`) and what Newton–Schulz orthogonalises (`shape`). A matrix cut along one mesh dimension is
    dealt round-robin over the group that cuts it, in the optimizer's order (make_optimizer's groups, one per
    placement, each in model order): every rank makes one gather (its slice to the owner) and one scatter (its
    slice back) per matrix, and the owner receives the other slices and orthogonalises the matrix. Counted
    here: the bytes rank 0 receives (fp32, unpadded, as the start line counts them): the others' slices in the
    gathers of the matrices it owns, its own slice in the scatters of the others. A matrix cut along two (FSDP
    beside TP) is dealt the same way over one group flattened from both (`flattened`: FSDP's x TP's ranks), with
    its own count (`cut_twice`, the matrices gathered on every rank, is then 0). Nothing
    sent for a whole matrix (replicated; an expert stack cut only along its experts), orthogonalised where it
    lies; but `replicas` > 1 (train_ddp.py's processes, which step alike) deal the whole matrices too: each
    orthogonalised by its owner and broadcast over dp_replicate (rank 0 receives the others, `dealt_whole`)."""
    traffic, dealt, received, flops = Traffic(), {}, 0, 0
    figures = dict.fromkeys(("matrices", "cut", "dealt_round_robin", "orthogonalised_rank0", "cut_twice"), 0)
    figures["dealt_whole"] = 0
    for m in sorted(matrices, key=lambda m: m["param_group"]):  # stable: model order inside a group
        figures["matrices"] += 1
        figures["cut"] += bool(m["cuts"])
        local, whole = m["local"], m["whole"]
        owner = True  # a whole matrix, or one cut twice: orthogonalised on this rank
        if not m["cuts"] and replicas > 1:  # DDP: dealt over the replicas; each owner broadcasts its result
            dealt["dp_replicate"] = n = dealt.get("dp_replicate", -1) + 1
            owner = n % replicas == 0
            figures["dealt_whole"] += 1
            figures["orthogonalised_rank0"] += owner
            traffic.add("dp_replicate", "broadcast", 1, 0 if owner else 4 * whole)
            received += 0 if owner else 4 * whole
        elif len(m["cuts"]) == 1:
            group, size = m["cuts"][0]
            dealt[m["cuts"][0]] = n = dealt.get(m["cuts"][0], -1) + 1
            owner = n % size == 0  # rank 0 of the group owns the 1st, (size+1)-th, ... matrix dealt
            figures["dealt_round_robin"] += 1
            figures["orthogonalised_rank0"] += owner
            traffic.add(group, "gather", 1, 4 * (whole - local) if owner else 0)
            traffic.add(group, "scatter", 1, 0 if owner else 4 * local)
            received += 4 * (whole - local) if owner else 4 * local
        elif m["cuts"]:  # cut twice: dealt over one group flattened from both (dp_shard(_cp) x tp), counted apart
            group, size = flattened(m["cuts"])
            dealt[group] = n = dealt.get(group, -1) + 1
            owner = n % size == 0
            figures["dealt_round_robin"] += 1
            figures["orthogonalised_rank0"] += owner
            traffic.add(group, "gather", 1, 4 * (whole - local) if owner else 0)
            traffic.add(group, "scatter", 1, 0 if owner else 4 * local)
            received += 4 * (whole - local) if owner else 4 * local
        flops += newton_schulz_flops(m["shape"], ns_steps) if owner else 0
    figures["received_mib_rank0"] = round(received / MiB, 4)
    figures["collectives_per_step_rank0"] = traffic.by_kind()
    figures["newton_schulz_flops_rank0"] = flops
    return traffic, figures


def newton_schulz_peak(args) -> float:
    """FLOP/s of the Newton–Schulz iteration, which runs in fp32 under bf16 too (common/muon.py): --peak_tflops
    in fp32 runs; under bf16, H100's ratio of fp32 to bf16 peak (67 / 989) applied to it."""
    if args.mixed_precision == "bf16":
        return args.peak_tflops * 1e12 * PEAK_TFLOPS["no"] / PEAK_TFLOPS["bf16"]
    return args.peak_tflops * 1e12


def collective_seconds(kind: str, nbytes: float, calls: int, size: int, link: dict) -> float:
    """Bus-bandwidth time (nccl-tests' convention): all-reduce moves 2(n-1)/n of the buffer,
    all-gather and reduce-scatter (n-1)/n of the full buffer, send/recv all of it (Muon's gathers and
    scatters: the bytes the rank receives, as muon_traffic counts them); plus latency."""
    factor = {"all_reduce": 2 * (size - 1) / size, "all_gather": (size - 1) / size, "reduce_scatter": (size - 1) / size}
    moved = nbytes * factor.get(kind, 1.0)
    return moved / (link["bandwidth_GBps"] * 1e9) + calls * link["latency_us"] * 1e-6


# ======================================== one layout
def plan_layout(cfg, params, n_params, layout: Layout, args, links: dict) -> dict:
    bf16 = args.mixed_precision == "bf16"
    m = args.n_microbatches
    micro_batch = args.batch_size // m
    state = {k: 0 for k in ("param_bytes", "grad_bytes", "optimizer_bytes", "total_bytes")}
    per_pp_rank, traffic, optimizer = [], [], []
    for pp_rank in range(layout.pp):
        rank = RankState(params, layout, pp_rank, args.stages_per_rank, cfg.n_layer)
        own = rank.state_bytes(args.optimizer)
        state = {k: max(state[k], own[k]) for k in state}  # each field's largest rank, as the runs report it
        act = stage_activation_bytes(  # CP: each rank keeps the activations of seq_len / cp tokens
            cfg, rank, micro_batch, args.seq_len // layout.cp, layout.tp, bf16, args.activation_checkpointing
        )
        in_flight = microbatches_in_flight(args.schedule, layout.pp, pp_rank, m, args.stages_per_rank)
        per_stage = act["per_microbatch"] / len(rank.stages)
        pipeline_act = per_stage * in_flight if layout.pp > 1 else act["per_microbatch"]
        # FSDP's gathered copies: two blocks' weights at a time (one computing, the next prefetched)
        # and one block's full gradient before its reduce-scatter. Inside a pipeline the weights stay
        # gathered from one backward to the next, and the gradients unsharded until the last backward;
        # so do the gradients of gradient accumulation with --unsharded_accumulation (by default each
        # micro-batch reduce-scatters them: one block's at a time). Under LoRA only the adapters have them.
        gathered = 0
        if fsdp_group(layout)[1] > 1:
            biggest = max(u["full"] for u in rank.units.values())
            biggest_trained = max(u.get("trained_full", 0) for u in rank.units.values())
            weights = (rank.full_numel() if layout.pp > 1 else 2 * biggest) * (2 if bf16 else 4)
            whole = m > 1 and (layout.pp > 1 or args.unsharded_accumulation)
            grads = (rank.full_numel(trained=True) if whole else biggest_trained) * 4
            gathered = weights + grads
        memory = own["total_bytes"] + pipeline_act + act["recompute"] + act["logits"] + gathered
        step, first = rank_traffic(cfg, layout, rank, pp_rank, args, bf16)
        traffic.append((step, first))
        ddp = layout.dp_replicate if layout.model_split * layout.cp == 1 else 1  # train_ddp.py's replicas
        optimizer.append(
            muon_traffic(rank.matrices, args.ns_steps, ddp) if args.optimizer == "muon" else (Traffic(), None)
        )
        per_pp_rank.append(
            {
                "pp_rank": pp_rank,
                "state_bytes": own["total_bytes"],
                "activation_bytes_per_microbatch": round(per_stage),
                "microbatches_in_flight": in_flight,
                "pipeline_activation_bytes": round(pipeline_act),
                "logits_and_recompute_bytes": act["logits"] + act["recompute"],
                "fsdp_gathered_bytes": gathered,
                "memory_bytes": round(memory),
            }
        )
    memory = max(r["memory_bytes"] for r in per_pp_rank)
    gpu_bytes = args.gpu_memory_gib * GiB

    # ---- the step time: roofline compute, the bubble, and the links' share
    fsdp, shards = fsdp_group(layout)  # dp_shard, or under CP dp_shard_cp
    sizes = {"tp": layout.tp, "pp": layout.pp, fsdp: shards, "dp_replicate": layout.dp_replicate}
    link_names = {group: link_of(layout, group, args.gpus_per_node) for group in sizes}
    flat, flat_size = flattened([(fsdp, shards), ("tp", layout.tp)])  # Muon's group for the matrices cut twice
    optimizer_sizes = sizes | {flat: flat_size}
    optimizer_links = link_names | {flat: link_of(layout, flat, args.gpus_per_node)}
    tokens_per_replica = args.batch_size * args.seq_len
    flops = flops_per_token(cfg, n_params, args.seq_len) * tokens_per_replica / (layout.pp * layout.tp * layout.cp)
    if args.activation_checkpointing:
        flops *= 4 / 3  # one more forward of every block: forward 1/3 of a training step's FLOPs
    peak = args.peak_tflops * 1e12
    compute_s = flops / peak
    bubble = bubble_theory(layout.pp, m, args.stages_per_rank) if layout.pp > 1 else 0.0
    worst = {"exposed": 0.0}
    for (step, _), (after, muon) in zip(traffic, optimizer, strict=True):  # the slowest pipeline rank sets the pace
        seconds = {"tp": 0.0, "pp": 0.0, "dp": 0.0, "optimizer": 0.0, "newton_schulz": 0.0}
        for (group, kind), (calls, nbytes) in step.items.items():
            t = collective_seconds(kind, nbytes, calls, sizes[group], links[link_names[group]])
            seconds["dp" if group.startswith("dp") else group] += t
        for (group, kind), (calls, nbytes) in after.items.items():  # Muon's, after the backward: nothing hides it
            link = links[optimizer_links[group]]
            seconds["optimizer"] += collective_seconds(kind, nbytes, calls, optimizer_sizes[group], link)
        if muon:  # and its Newton–Schulz iterations, after the backward too, in fp32
            seconds["newton_schulz"] = muon["newton_schulz_flops_rank0"] / newton_schulz_peak(args)
        hidden = 0.0 if args.no_overlap else compute_s  # FSDP and DDP overlap compute (GPUs), not on CPUs
        exposed = seconds["tp"] + seconds["pp"] + seconds["optimizer"] + seconds["newton_schulz"]
        exposed += max(0.0, seconds["dp"] - hidden)
        if exposed >= worst["exposed"]:
            worst = {"exposed": exposed, **seconds}
    ring = ring_traffic(cfg, layout, args, micro_batch, bf16, links)
    if args.cp_impl == "ulysses":  # CP: the all-to-alls wait for their data: on the critical path
        step_s = compute_s / (1 - bubble) + worst["exposed"] + ring["seconds"]
    else:
        step_s = compute_s / (1 - bubble) + worst["exposed"] + max(0.0, ring["seconds"] - compute_s)  # overlapped
    tokens_per_s = tokens_per_replica * layout.dp / step_s

    step0, first0 = traffic[0]
    comm, optimizer_comm = (
        [
            {
                "group": group,
                "kind": kind,
                "calls": calls,
                "bytes": round(nbytes),
                "link": optimizer_links[group],
            }
            for (group, kind), (calls, nbytes) in sorted(items.items.items())
        ]
        for items in (step0, optimizer[0][0])  # forward and backward; Muon's optimizer step
    )
    return {
        "layout": layout.describe(),
        "state_bytes_per_rank_max": state,
        "ddp_state_bytes_per_rank": ddp_bytes(params, n_params, args.optimizer),
        "per_pp_rank": per_pp_rank,
        "memory_bytes_per_rank_max": memory,
        "gpu_memory_bytes": gpu_bytes,
        "fits": memory <= gpu_bytes,
        "headroom_bytes": gpu_bytes - memory,
        "collectives_per_step_rank0": comm,
        "collectives_first_step_rank0": step0.merged(first0).by_kind(),  # forward and backward, as the runs count
        "optimizer_collectives_per_step_rank0": optimizer_comm,  # Muon's, after the backward (muon_traffic)
        "links": {group: link_names[group] for group, size in sizes.items() if size > 1},
        "compute_s": round(compute_s, 6),
        "bubble": round(bubble, 4),
        "tp_s": round(worst.get("tp", 0.0), 6),
        "pp_s": round(worst.get("pp", 0.0), 6),
        "dp_s": round(worst.get("dp", 0.0), 6),
        "optimizer_s": round(worst.get("optimizer", 0.0), 6),
        "newton_schulz_s": round(worst.get("newton_schulz", 0.0), 6),
        "step_time_s": round(step_s, 6),
        "tokens_per_s": round(tokens_per_s, 1),
        "mfu": round(flops_per_token(cfg, n_params, args.seq_len) * tokens_per_s / (peak * layout.world_size), 4),
        "global_batch_size": args.batch_size * layout.dp,
        **(cp_record(ring, args.cp_impl) if layout.cp > 1 else {}),
        **({"muon": optimizer[0][1]} if args.optimizer == "muon" else {}),
    }


def ddp_bytes(params: list[dict], n_params: int, optimizer: str) -> dict:
    """What DDP would hold on every rank (common/sharded_costs.py's ddp_state_bytes): every parameter, and
    the gradients and optimizer state of those that train (under LoRA the adapters only; Muon: one momentum
    for its matrices, AdamW's two moments for the rest)."""
    n_train = sum(math.prod(p["shape"]) for p in params if p.get("trains", True))
    n_muon = sum(math.prod(p["shape"]) for p in params if p.get("trains", True) and p.get("muon"))
    figures = ddp_state_bytes(n_train, optimizer, n_muon / max(n_train, 1))
    figures["param_bytes"] = 4 * n_params
    figures["total_bytes"] = figures["param_bytes"] + figures["grad_bytes"] + figures["optimizer_bytes"]
    return figures


def cp_record(traffic: dict, impl: str) -> dict:
    """What a plan says of CP's traffic: the ring's K/V bytes per layer, or Ulysses' all-to-all buffers."""
    if impl == "ulysses":
        return {
            "cp_impl": impl,
            "ulysses_all_to_all_bytes_per_layer": traffic["per_layer"],
            "ulysses_all_to_all_calls_per_layer": traffic["calls_per_layer"],
            "ulysses_s": round(traffic["seconds"], 6),
        }
    steps = {"ring_steps": traffic["steps"]} if "steps" in traffic else {}
    return {
        "cp_impl": impl,
        "ring_bytes_per_layer": traffic["per_layer"],
        "ring_sends_per_layer": traffic["sends_per_layer"],
        "ring_s": round(traffic["seconds"], 6),
    } | steps


def ring_traffic(cfg, layout: Layout, args, micro_batch: int, bf16: bool, links: dict) -> dict:
    """Context parallelism's ring (train_cp.py), per rank: a K/V block is 2 x micro-batch x seq/cp x d/tp;
    per layer and micro-batch (cp-1) blocks in forward, (cp-1) K/V plus cp dK/dV blocks in backward, each one
    send and one receive (batch_isend_irecv: the runs count them as send and recv, one call each). A ring
    of tp x cp consecutive ranks stays inside a node while it fits; its time is bytes over the measured
    point-to-point bandwidth (preflight's ring_p2p), else the link's all-reduce bandwidth. With
    --sliding_window, the ring stops after the steps some rank still needs (context_parallel.ring_steps, on the
    chunks it would choose): S steps send S-1 K/V blocks each way and S dK/dV blocks (none when S is 1).
    --cp_impl ulysses: ulysses_traffic instead."""
    if args.cp_impl == "ulysses":
        return ulysses_traffic(cfg, layout, args, micro_batch, bf16, links)
    block = 2 * micro_batch * (args.seq_len // layout.cp) * cfg.n_embd // layout.tp * (2 if bf16 else 4)
    steps, window = layout.cp, getattr(args, "sliding_window", None)
    if window and layout.cp > 1:
        chunks_of = cp_chunks(layout.cp, "ring", [window], args.seq_len)
        steps = ring_steps(chunks_of, args.seq_len // sum(map(len, chunks_of)), window)
    per_layer = {"forward": (steps - 1) * block, "backward": ((steps - 1) + (steps if steps > 1 else 0)) * block}
    link = links["intra_node" if layout.tp * layout.cp <= args.gpus_per_node else "inter_node"]
    bandwidth = link.get("ring_p2p_GBps") or link["bandwidth_GBps"]
    layers = math.ceil(cfg.n_layer / layout.pp)
    sends = 3 * steps - 2 if steps > 1 else 0  # the blocks above, one send each
    calls = sends * layers * args.n_microbatches
    total = sum(per_layer.values()) * layers * args.n_microbatches
    seconds = total / (bandwidth * 1e9) + calls * link["latency_us"] * 1e-6
    return {"per_layer": per_layer, "sends_per_layer": sends, "seconds": seconds} | ({"steps": steps} if window else {})


def ulysses_traffic(cfg, layout: Layout, args, micro_batch: int, bf16: bool, links: dict) -> dict:
    """Ulysses (train_cp.py --cp_impl ulysses), per rank, layer and micro-batch: 4 all-to-alls in forward (q,
    k, v to head shards, the output back) and 4 in backward, each a buffer of micro-batch x seq/cp tokens x
    heads x head_dim (the K/V heads arrive repeated to the query heads: the model's attention contract);
    (cp-1)/cp of each leaves the rank, at the link's bandwidth, and nothing computes meanwhile."""
    q_width = cfg.n_head * (getattr(cfg, "head_dim", None) or cfg.n_embd // cfg.n_head)
    per_layer = ulysses_bytes_per_layer(micro_batch, args.seq_len, layout.cp, q_width, q_width, 2 if bf16 else 4)
    link = links["intra_node" if layout.cp <= args.gpus_per_node else "inter_node"]
    layers = math.ceil(cfg.n_layer / layout.pp)
    calls = per_layer["calls"] * layers * args.n_microbatches if layout.cp > 1 else 0
    moved = (per_layer["forward"] + per_layer["backward"]) * per_layer["leaves"] * layers * args.n_microbatches
    return {
        "per_layer": {"forward": per_layer["forward"], "backward": per_layer["backward"]},
        "calls_per_layer": per_layer["calls"],
        "seconds": moved / (link["bandwidth_GBps"] * 1e9) + calls * link["latency_us"] * 1e-6,
    }


# ======================================== which layouts
def candidate_layouts(world_size: int, fixed: dict) -> list[Layout]:
    """Every pp x dp_replicate x dp_shard x tp = world_size that agrees with the fixed degrees."""
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    found = []
    for pp, dp_replicate, tp in itertools.product(divisors, repeat=3):
        others = pp * dp_replicate * tp
        if world_size % others:
            continue
        degrees = {"pp": pp, "dp_replicate": dp_replicate, "dp_shard": world_size // others, "tp": tp}
        if all(fixed[d] is None or fixed[d] == degrees[d] for d in DIMS):
            found.append(Layout(**degrees, world_size=world_size))
    return found


def layout_args(layout: Layout, args) -> argparse.Namespace:
    """The flags as this layout's run would take them: with --global_batch_size, each data-parallel
    rank's share of it becomes --batch_size."""
    if not args.global_batch_size:
        return args
    if args.global_batch_size % layout.dp:
        raise UsageError(
            f"--global_batch_size {args.global_batch_size} does not split over {layout.dp} data-parallel ranks"
        )
    return argparse.Namespace(**{**vars(args), "batch_size": args.global_batch_size // layout.dp})


def why_invalid(layout: Layout, cfg: GPTConfig, args) -> str | None:
    """The training scripts' own checks (model.py, common/pp_checks.py): None when the layout can run."""
    try:
        if isinstance(cfg, HFShape):
            cfg.check_split(layout.tp, layout.pp * args.stages_per_rank, args.stages_per_rank)
        else:
            check_gpt_split(cfg, layout.tp, layout.pp * args.stages_per_rank, args.stages_per_rank)
        if args.batch_size % args.n_microbatches:
            raise UsageError(
                f"--batch_size {args.batch_size} cannot be split into --n_microbatches {args.n_microbatches}"
            )
        if layout.cp > 1 and args.cp_impl == "ulysses" and (layout.tp > 1 or layout.pp > 1):
            raise UsageError("--cp_impl ulysses runs in train_cp.py, which has no TP or PP: --tp_size 1 --pp_size 1")
        if layout.pp > 1:
            check_pipeline_layout(layout, cfg.n_layer, args)
        elif args.stages_per_rank > 1:
            raise UsageError(f"--schedule {args.schedule} needs a pipeline (--pp_size 2 or more)")
    except UsageError as e:
        return str(e)
    return None


def ranking_key(record: dict):
    """Layouts that fit first, then the fastest (tokens per second)."""
    return (not record["fits"], -record["tokens_per_s"])


# ======================================== input
def read_network(path: str) -> dict:
    """The links measured by scripts/preflight.py: all-reduce bus bandwidth (1e9 bytes/s) and
    latency inside a node and between nodes; a link it could not measure (null) keeps its default."""
    try:
        result = json.loads(Path(path).read_text())
    except OSError as e:
        raise UsageError(
            f"--network {path}: cannot read it ({e.strerror}): give the JSON file preflight.py wrote"
        ) from None
    except ValueError as e:
        raise UsageError(f"--network {path} is not JSON ({e}): give the JSON file preflight.py wrote") from None
    if not isinstance(result, dict) or result.get("format") != PREFLIGHT_FORMAT:
        raise UsageError(
            f'--network {path} is not a preflight result (no "format": "{PREFLIGHT_FORMAT}"): '
            "give the JSON file preflight.py wrote"
        )
    links = {}
    for name in DEFAULT_LINKS:
        link = (result.get("links") or {}).get(name)
        if link is None:
            continue
        try:
            bandwidth, latency = float(link["bandwidth_GBps"]), float(link["latency_us"])
        except (TypeError, KeyError, ValueError):
            raise UsageError(
                f"--network {path}: links.{name} needs numbers bandwidth_GBps and latency_us: "
                "give the JSON file preflight.py wrote"
            ) from None
        if bandwidth <= 0 or latency < 0:
            raise UsageError(f"--network {path}: links.{name} has bandwidth {bandwidth} GB/s, latency {latency} us")
        links[name] = {"bandwidth_GBps": bandwidth, "latency_us": latency}
        if isinstance(link.get("ring_p2p_GBps"), (int, float)) and link["ring_p2p_GBps"] > 0:
            links[name]["ring_p2p_GBps"] = float(link["ring_p2p_GBps"])  # CP's ring: send/recv bandwidth
    return links


def build_args() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter, epilog=EPILOG)
    g = p.add_argument_group("model (the training scripts' presets and overrides)")
    g.add_argument("--model_size", default="1b", help=f"preset: {' | '.join(MODEL_PRESETS)}")
    g.add_argument("--n_layer", type=int, help="override the preset's layer count")
    g.add_argument("--n_head", type=int, help="override the preset's head count")
    g.add_argument("--n_embd", type=int, help="override the preset's width")
    g.add_argument("--block_size", type=int, help="override the preset's (or the 🤗 config's) context length")
    g.add_argument(
        "--model_config",
        help="plan a 🤗 transformers model instead: a config JSON file (with model_type) or a folder with "
        "config.json, read offline and built on the meta device, dense or MoE (MoE: train_ep.py's layouts)",
    )
    g.add_argument(
        "--vocab_size",
        type=int,
        default=256,
        help="with --model_config: the vocabulary as the scripts build it from a config (256 bytes); 0 keeps "
        "the config's own",
    )
    g = p.add_argument_group("machines")
    g.add_argument("--world_size", type=int, required=True, help="GPUs (processes) of the job")
    g.add_argument(
        "--gpus_per_node", type=int, default=8, help="GPUs per machine: where TP, FSDP and PP groups cross nodes"
    )
    g.add_argument("--gpu_memory_gib", type=float, default=80, help="memory of one GPU, GiB")
    g.add_argument(
        "--peak_tflops",
        type=float,
        help="dense peak TFLOP/s of one GPU (default: H100 SXM, 989 with --mixed_precision bf16, 67 in fp32); "
        "--optimizer muon's Newton–Schulz runs in fp32, at 67 / 989 of it under bf16",
    )
    for name, label in (("intra_node", "inside a node"), ("inter_node", "between nodes")):
        default = DEFAULT_LINKS[name]
        g.add_argument(
            f"--{name}_GBps",
            type=float,
            help=f"all-reduce bus bandwidth {label}, 1e9 bytes/s "
            f"(default: --network's measurement, else {default['bandwidth_GBps']:g})",
        )
        g.add_argument(
            f"--{name}_latency_us",
            type=float,
            help=f"latency of one collective {label}, microseconds "
            f"(default: --network's measurement, else {default['latency_us']:g})",
        )
    g.add_argument("--network", help="a preflight result (JSON written by scripts/preflight.py): measured links")
    g.add_argument(
        "--no_overlap",
        action="store_true",
        help="the data-parallel collectives do not overlap the compute: add their time to it (CPUs with gloo, where "
        "one thread does both; default: overlapped, as on GPUs)",
    )
    g = p.add_argument_group("layout (give none to rank every valid one; any you give are kept fixed)")
    for dim, help_text in (
        ("pp", "pipeline stages"),
        ("dp_replicate", "data-parallel replicas (HSDP: replicate across them)"),
        ("dp_shard", "data-parallel ranks that shard the model (FSDP; with --cp_size, over dp_shard x cp)"),
        ("tp", "ranks per tensor-parallel group"),
    ):
        g.add_argument(FLAGS[dim], type=int, dest=dim, help=f"{help_text} (default: every value that fits)")
    g.add_argument(
        "--cp_size",
        type=int,
        default=1,
        help="context parallel (train_cp.py, train_hybrid.py): ranks that cut each sequence, kept fixed; "
        "activations and TP's traffic per rank / cp, plus the ring's K/V traffic; FSDP shards over dp_shard x cp "
        "(dp_shard_cp: CP ranks hold the same weights); the other degrees multiply to --world_size / cp",
    )
    g.add_argument(
        "--cp_impl",
        choices=["ring", "ulysses"],
        default="ring",
        help="how --cp_size cuts (train_cp.py --cp_impl): ring, K/V around the ranks (hidden behind compute); "
        "ulysses, 8 all-to-alls per layer (q, k, v, output; forward and backward), the heads divisible by cp",
    )
    g.add_argument(
        "--sliding_window",
        type=int,
        default=None,
        help="tokens each query attends to in every layer (a config's sliding_window, as Mistral's): the ring "
        "stops after the steps some rank still needs and sends fewer K/V (train_cp.py); Ulysses' bytes stay",
    )
    g = p.add_argument_group("training step (as the training scripts take it)")
    g.add_argument(
        "--batch_size",
        type=int,
        default=8,
        help="samples per data-parallel rank and step, split into --n_microbatches "
        "(pipeline micro-batches; without a pipeline: gradient accumulation)",
    )
    g.add_argument(
        "--global_batch_size",
        type=int,
        help="samples per step for the whole job: each layout's --batch_size becomes its share per data-parallel "
        "rank, so every layout trains on the same batch (default: --batch_size per data-parallel rank)",
    )
    g.add_argument("--seq_len", type=int, help="tokens per sample (default: the model's --block_size)")
    g.add_argument("--n_microbatches", type=int, default=8, help="micro-batches each --batch_size is split into")
    g.add_argument("--schedule", default="1f1b", help=f"pipeline schedule: {' | '.join(SCHEDULES)}")
    g.add_argument(
        "--optimizer",
        default="adamw",
        help="adamw | sgd (plain SGD keeps no state) | muon (one fp32 momentum for the hidden matrices, AdamW for "
        "the rest; after each backward the matrices FSDP, TP or EP's FSDP cut are gathered whole and scattered "
        "back, and each rank's Newton–Schulz FLOPs join the step, at the fp32 peak)",
    )
    g.add_argument(
        "--ns_steps",
        type=int,
        default=5,
        help="as the scripts' flag: --optimizer muon's Newton–Schulz iterations per matrix and step; each costs "
        "4·A·A·B + 2·A³ FLOPs for an A x B matrix, A <= B",
    )
    g.add_argument(
        "--activation_checkpointing", action="store_true", help="recompute each block's activations in backward"
    )
    g.add_argument(
        "--skip_cut_check",
        action="store_true",
        help="as the scripts' flag: without the start-up cut check, the run's first step is also the pipeline's "
        "first call (its stages agree on shapes then); with it, the check's probe step did that before step 1",
    )
    g.add_argument(
        "--unsharded_accumulation",
        action="store_true",
        help="as train_fsdp.py's flag: without a pipeline, keep whole-model unsharded gradients through the "
        "--n_microbatches of a step and reduce-scatter once (default: a reduce-scatter per micro-batch, sharded "
        "gradients)",
    )
    g.add_argument(
        "--lora_r",
        type=int,
        help="as the scripts' flag: train LoRA adapters of this rank beside the frozen model: the weights all "
        "count, gradients and optimizer state only the adapters' (A: r x in, B: out x r per adapted layer, cut by "
        "TP to follow it, sharded by FSDP); default: every weight trains",
    )
    g.add_argument(
        "--lora_target_modules",
        help="with --lora_r: the linear layers to adapt, comma-separated last name parts (e.g. q_proj,v_proj; "
        "default: every linear layer named *proj but the output head, as the scripts choose them)",
    )
    g.add_argument(
        "--mixed_precision",
        default="no",
        help="no | bf16, as given to accelerate launch: bf16 halves activations and gathered weights "
        "(master weights, gradients and Adam state stay fp32)",
    )
    g = p.add_argument_group("mixture of experts (train_ep.py: expert parallel; docs/ep.md)")
    g.add_argument("--n_experts", type=int, default=0, help="experts per MoE layer (0: a dense model)")
    g.add_argument("--top_k", type=int, default=2, help="experts each token is sent to")
    g.add_argument("--moe_every", type=int, default=1, help="every n-th block's MLP is a mixture of experts")
    g.add_argument("--expert_hidden", type=int, default=0, help="hidden width of an expert (0: 4 x n_embd / top_k)")
    g.add_argument("--ep_size", type=int, help="ranks the experts are cut over (default: every value that divides)")
    g = p.add_argument_group("output")
    g.add_argument("--top", type=int, default=20, help="rows of the table (0: all); --json lists every layout")
    g.add_argument(
        "--json", action="store_true", help="also print the records as one JSON list, the last line of stdout"
    )
    return p


EPILOG = """example:
  python scripts/plan_layout.py --model_size 1b --world_size 64 --mixed_precision bf16 --batch_size 8
  python scripts/plan_layout.py --model_size 1b --n_layer 32 --n_embd 4096 --n_head 32 --world_size 64 \\
      --mixed_precision bf16 --activation_checkpointing --network preflight.json --json
"""


def hf_model(args) -> HFShape:
    """--model_config: the 🤗 model, with the flags that cannot apply to it refused."""
    for flag in ("n_layer", "n_head", "n_embd", "n_experts"):
        if getattr(args, flag):
            raise UsageError(f"--{flag} changes the built-in GPT: with --model_config, edit the config instead")
    if args.vocab_size < 0:
        raise UsageError(f"--vocab_size must be 0 (the config's) or positive (got {args.vocab_size})")
    hf = HFShape(args.model_config, args.vocab_size, args.block_size, args.lora_r, args.lora_target_modules)
    if hf.n_experts:
        args.seq_len = args.seq_len or hf.block_size
        if args.ep_size is not None and (
            args.ep_size < 1 or args.world_size % args.ep_size or hf.n_experts % args.ep_size
        ):
            raise UsageError(
                f"--ep_size {args.ep_size} must divide --world_size {args.world_size} (every rank is a "
                f"data-parallel rank) and the model's {hf.n_experts} experts: choose an --ep_size that divides both"
            )
    return hf


def check_args(args, hf: HFShape | None = None) -> GPTConfig | HFShape:
    """One line per bad flag, naming the fix (exit 2)."""
    if hf is None and args.model_size not in MODEL_PRESETS:
        raise UsageError(f"--model_size {args.model_size!r} is not a preset: choose {', '.join(MODEL_PRESETS)}")
    for flag in (
        "world_size",
        "gpus_per_node",
        "batch_size",
        "n_microbatches",
        "n_layer",
        "n_head",
        "n_embd",
        "block_size",
    ):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag} must be at least 1 (got {value})")
    for dim in DIMS:
        if getattr(args, dim) is not None and getattr(args, dim) < 1:
            raise UsageError(
                f"{FLAGS[dim]} must be at least 1 (got {getattr(args, dim)}); leave it out to try every value"
            )
    if args.gpu_memory_gib <= 0:
        raise UsageError(f"--gpu_memory_gib must be positive (got {args.gpu_memory_gib})")
    if args.schedule not in SCHEDULES:
        raise UsageError(f"--schedule {args.schedule!r} is not supported: choose {', '.join(SCHEDULES)}")
    if args.mixed_precision not in ("no", "bf16"):
        raise UsageError(f"--mixed_precision {args.mixed_precision!r}: the sharded scripts run no or bf16")
    if args.global_batch_size is not None and args.global_batch_size < 1:
        raise UsageError(f"--global_batch_size must be at least 1 (got {args.global_batch_size})")
    if not args.global_batch_size and args.batch_size % args.n_microbatches:
        raise UsageError(
            f"--batch_size {args.batch_size} cannot be split into --n_microbatches {args.n_microbatches} equal "
            "micro-batches: use a batch size divisible by it"
        )
    cfg = hf or GPTConfig.from_preset(
        args.model_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size
    )
    if cfg.n_embd % cfg.n_head and not hf:
        raise UsageError(
            f"--n_embd {cfg.n_embd} is not divisible by --n_head {cfg.n_head}: "
            "choose a head count that divides the width"
        )
    args.seq_len = args.seq_len or cfg.block_size
    if not 1 <= args.seq_len <= cfg.block_size:
        raise UsageError(
            f"--seq_len {args.seq_len} exceeds the model's --block_size {cfg.block_size}: raise --block_size"
        )
    chunks = 2 * args.cp_size if args.cp_impl == "ring" else args.cp_size  # head-tail, or chunk r of cp
    if args.cp_size < 1 or args.world_size % args.cp_size or (args.cp_size > 1 and args.seq_len % chunks):
        cut = "2 x cp must divide" if args.cp_impl == "ring" else "cp must divide"
        raise UsageError(
            f"--cp_size {args.cp_size} must divide --world_size {args.world_size}, and {cut} --seq_len "
            f"{args.seq_len} ({'head-tail chunks' if args.cp_impl == 'ring' else 'Ulysses'}): choose a --cp_size "
            "that divides both"
        )
    if args.cp_size > 1 and args.cp_impl == "ulysses" and cfg.n_head % args.cp_size:
        raise UsageError(
            f"--cp_size {args.cp_size} --cp_impl ulysses cuts the attention heads over {args.cp_size} ranks, but "
            f"the model has {cfg.n_head} query heads: use a --cp_size that divides the heads, or --cp_impl ring"
        )
    world = args.world_size // args.cp_size  # what the four other degrees multiply to
    fixed = [getattr(args, d) for d in DIMS if getattr(args, d) is not None]
    if len(fixed) == len(DIMS):  # all four given: the training scripts' own message when they do not multiply out
        Layout.from_degrees(world, pp=args.pp, dp_replicate=args.dp_replicate, dp_shard=args.dp_shard, tp=args.tp)
    elif world % math.prod(fixed):
        given = " x ".join(f"{FLAGS[d]} {getattr(args, d)}" for d in DIMS if getattr(args, d) is not None)
        raise UsageError(
            f"{given} = {math.prod(fixed)} does not divide --world_size {args.world_size}: "
            "choose degrees whose product divides the world size"
        )
    args.stages_per_rank = 2 if args.schedule in MULTI_STAGE_SCHEDULES else 1
    args.gradient_accumulation_steps, args.split_points = 1, None  # what check_pipeline_layout reads
    args.peak_tflops = args.peak_tflops or PEAK_TFLOPS[args.mixed_precision]
    if args.peak_tflops <= 0:
        raise UsageError(f"--peak_tflops must be positive (got {args.peak_tflops})")
    return cfg


def link_settings(args) -> dict:
    """Defaults, then --network's measurements, then the flags given."""
    links = {name: dict(values) for name, values in DEFAULT_LINKS.items()}
    if args.network:
        links.update(read_network(args.network))
    for name in links:
        for key, flag in (("bandwidth_GBps", f"{name}_GBps"), ("latency_us", f"{name}_latency_us")):
            value = getattr(args, flag)
            if value is not None:
                if value <= 0 and key == "bandwidth_GBps" or value < 0:
                    raise UsageError(f"--{flag} must be positive (got {value})")
                links[name][key] = value
    return links


# ======================================== output
def describe(layout: dict) -> str:
    return "x".join(str(layout[d]) for d in DIMS)


def table(records: list[dict], top: int, given: bool) -> str:
    header = (
        f"{'#':>3}  {'pp x dpr x dps x tp':<19} {'state':>8} {'activ.':>8} {'total':>8} {'fits':<13} "
        f"{'tp link':<6} {'comm GB/step':>12} {'step ms':>9} {'tokens/s':>11} {'MFU':>5}"
    )
    lines = [header, "-" * len(header)]
    for i, r in enumerate(records[: top or None] if top else records):
        worst = max(r["per_pp_rank"], key=lambda x: x["memory_bytes"])
        activations = worst["pipeline_activation_bytes"] + worst["logits_and_recompute_bytes"]
        headroom = r["headroom_bytes"] / GiB
        fits = f"yes +{headroom:.1f}" if r["fits"] else f"NO {headroom:.1f}"
        tp_link = {"intra_node": "node", "inter_node": "CROSS"}.get(r["links"].get("tp"), "-")
        comm = sum(c["bytes"] for c in r["collectives_per_step_rank0"] + r["optimizer_collectives_per_step_rank0"])
        comm /= 1e9  # GB, Muon's gathers and scatters included
        label = ("given " if given and i == 0 else "") + describe(r["layout"])
        lines.append(
            f"{r['rank']:>3}  {label:<19} {worst['state_bytes'] / GiB:>7.2f}G {activations / GiB:>7.2f}G "
            f"{r['memory_bytes_per_rank_max'] / GiB:>7.2f}G {fits:<13} {tp_link:<6} {comm:>12.3f} "
            f"{r['step_time_s'] * 1e3:>9.1f} {r['tokens_per_s']:>11.0f} {r['mfu']:>5.2f}"
        )
    return "\n".join(lines)


# ======================================== mixture of experts: train_ep.py's layouts
def moe_config(args) -> GPTConfig:
    """The MoE model of the flags (the training scripts' checks and their error lines)."""
    cfg = gpt_config_from_args(args)  # the MoE flags the planner lacks keep their defaults
    args.seq_len = args.seq_len or cfg.block_size
    if args.ep_size is not None and (
        args.ep_size < 1 or args.world_size % args.ep_size or cfg.n_experts % args.ep_size
    ):
        raise UsageError(
            f"--ep_size {args.ep_size} must divide --world_size {args.world_size} (every rank is a data-parallel "
            f"rank) and --n_experts {cfg.n_experts}: choose an --ep_size that divides both"
        )
    return cfg


def ep_parameters(cfg) -> tuple[list[dict], int]:
    """Name, shape, whether an expert's (`.experts.` in the name: a batched (E, ...) weight) and whether Muon
    takes it (common/muon.py's muon_matrices), of every parameter in model order (model.parameters()'s), read
    off the meta model; and their count."""
    if isinstance(cfg, HFShape):  # a 🤗 MoE: its experts' batched weights, read off the meta model
        params = [{"name": p["name"], "shape": p["shape"], "muon": p["muon"]} for p in cfg.params]
        total = cfg.n_params
    else:
        with torch.device("meta"):
            model = GPT(cfg)
        matrices = {id(p) for p in muon_matrices(model)}
        params = [{"name": n, "shape": tuple(p.shape), "muon": id(p) in matrices} for n, p in model.named_parameters()]
        total = count_parameters(model)
    return [p | {"expert": ".experts." in p["name"]} for p in params], total


def ep_rank_state(params: list[dict], ep: int, dp: int) -> tuple[dict, list[dict]]:
    """What rank 0 of train_ep.py holds (the largest shards: torch.chunk gives the first ranks the most), as
    state_bytes_per_rank_max counts it, and its Muon matrices (muon_traffic's `matrices`). On one process
    nothing is cut. Else, the parameters that are not experts: FSDP over all dp ranks (Shard(0), one group
    "dp"); the experts: EP's Shard(0) over the ep ranks of a group ("dp_shard": a stack's dimension, which cuts
    no matrix) and FSDP's Shard(1) over the dp / ep groups ("dp_replicate", the same process group as "dp" when
    ep is 1). Optimizer groups: one per placement, in the order the placements first appear (make_optimizer's)."""
    slices = dp // ep
    held = {"all": 0, "experts": 0, "muon": 0, "tensors": 0, "muon_tensors": 0}
    kinds, matrices = [], []
    for p in params:
        shape, ndim = p["shape"], len(p["shape"])
        kind, whole_shape, shards = None, shape, []  # one process: whole, plain tensors
        local = math.prod(shape)
        if dp > 1 and p["expert"]:  # mesh dims (dp_replicate, dp_shard): Shard(1), Shard(0)
            rows = shape[0] // ep
            local = rows * fsdp_rows(shape[1], slices)[0] * math.prod(shape[2:]) if ndim > 1 else rows
            shards = [("dp" if ep == 1 else "dp_replicate", slices, 1), ("dp_shard", ep, 0)]
            kind, whole_shape = "experts", (rows, *shape[1:])  # this ep rank's experts, gathered whole
        elif dp > 1:
            local = fsdp_rows(shape[0], dp)[0] * math.prod(shape[1:])
            kind, shards = "dp", [("dp", dp, 0)]
        held["all"] += local
        held["experts"] += local * p["expert"]
        held["tensors"] += 1
        if ndim >= 2 and kind not in kinds:
            kinds.append(kind)
        if not p["muon"]:
            continue
        held["muon"] += local
        held["muon_tensors"] += 1
        cuts = [(group, n) for group, n, dim in reversed(shards) if n > 1 and dim >= ndim - 2]  # cutting_dims'
        whole = math.prod(shape) if len(cuts) > 1 else math.prod(whole_shape)  # cut twice: full_tensor, all of it
        matrices.append(
            {"param_group": kinds.index(kind), "cuts": cuts, "local": local, "whole": whole, "shape": whole_shape}
        )
    return held, matrices


def ep_state_bytes(held: dict, optimizer: str) -> dict:
    """fp32 parameters and gradients; AdamW two moments and a 4-byte step count per tensor, Muon one momentum
    for its matrices (RankState.state_bytes' rule)."""
    muon, muon_tensors = (held["muon"], held["muon_tensors"]) if optimizer == "muon" else (0, 0)
    optim = 4 * muon + 8 * (held["all"] - muon) + 4 * (held["tensors"] - muon_tensors) if optimizer != "sgd" else 0
    figures = {"param_bytes": 4 * held["all"], "grad_bytes": 4 * held["all"], "optimizer_bytes": optim}
    return figures | {"total_bytes": sum(figures.values())}


def plan_ep(cfg: GPTConfig, args, ep: int, links: dict) -> dict:
    """train_ep.py on --world_size ranks (all data-parallel), experts cut over ep of them:
    - state per rank (ep_rank_state): the parameters that are not experts, FSDP-sharded over all ranks, plus
      E / ep experts cut again over the dp / ep groups (FSDP along dim 1: E / dp experts' worth per rank),
      each with its gradient and optimizer state; while a MoE layer computes, its E / ep experts are
      gathered whole (one layer at a time, like FSDP's units);
    - all-to-all per MoE layer and micro-batch: tokens x top_k x n_embd x bytes, twice (dispatch and
      combine), in forward and again in backward; (ep - 1) / ep of it leaves the rank;
    - active parameters: what a token goes through (top_k experts of E), against the total;
    - --optimizer muon (muon_traffic): one momentum for Muon's matrices (the experts' stacks among them), AdamW's
      two moments for the rest; the matrices FSDP cuts dealt round-robin (a gather and a scatter each), the
      expert stacks EP alone cuts orthogonalised where they lie; rank 0's Newton–Schulz FLOPs.
    FSDP's own collectives are not costed here."""
    params, total = ep_parameters(cfg)
    experts = sum(math.prod(p["shape"]) for p in params if p["expert"])
    n_moe = len(cfg.moe_layers) if isinstance(cfg, HFShape) else sum(cfg.is_moe_block(i) for i in range(cfg.n_layer))
    slices = args.world_size // ep  # the dp / ep groups that cut each rank's experts again (dim 1)
    active = total - experts * (cfg.n_experts - cfg.top_k) // cfg.n_experts
    held, matrices = ep_rank_state(params, ep, args.world_size)
    state = ep_state_bytes(held, args.optimizer)
    gathered_bytes = 4 * experts // ep // max(n_moe, 1)  # one MoE layer's E / ep experts, whole
    act_bytes = 2 if args.mixed_precision == "bf16" else 4
    tokens = args.batch_size * args.seq_len
    a2a_layer = tokens * cfg.top_k * cfg.n_embd * act_bytes * 2 * 2  # dispatch + combine, forward + backward
    a2a_step = a2a_layer * n_moe
    link = links["intra_node" if ep <= args.gpus_per_node else "inter_node"]
    a2a_seconds = (
        a2a_step * (ep - 1) / ep / (link["bandwidth_GBps"] * 1e9) + 4 * n_moe * link["latency_us"] * 1e-6
    ) * (ep > 1)  # ep 1: every token stays on its rank
    compute_seconds = 6 * active * tokens / (args.peak_tflops * 1e12)
    memory = state["total_bytes"] + 2 * gathered_bytes  # + one MoE layer's experts, weights and gradients
    muon = {}
    if args.optimizer == "muon":  # Muon's gathers and scatters, and Newton–Schulz, after the backward
        traffic, figures = muon_traffic(matrices, args.ns_steps)
        layout = Layout(pp=1, dp_replicate=slices, dp_shard=ep, tp=1, world_size=args.world_size)
        flat = Layout(pp=1, dp_replicate=1, dp_shard=args.world_size, tp=1, world_size=args.world_size)
        groups = {"dp": (args.world_size, link_of(flat, "dp_shard", args.gpus_per_node))}
        groups |= {
            d: (getattr(layout, d), link_of(layout, d, args.gpus_per_node)) for d in ("dp_replicate", "dp_shard")
        }
        comm = [
            {"group": g, "kind": k, "calls": c, "bytes": round(b), "link": groups[g][1]}
            for (g, k), (c, b) in sorted(traffic.items.items())
        ]
        optimizer_s = sum(
            collective_seconds(k, b, c, groups[g][0], links[groups[g][1]]) for (g, k), (c, b) in traffic.items.items()
        )
        muon = {
            "muon": figures,
            "optimizer_collectives_per_step_rank0": comm,
            "optimizer_s": round(optimizer_s, 6),
            "newton_schulz_s": round(figures["newton_schulz_flops_rank0"] / newton_schulz_peak(args), 6),
        }
    return {
        "ep": ep,
        "dp": args.world_size,
        "expert_slices": slices,
        "experts_per_rank": cfg.n_experts // ep,
        "total_params": total,
        "active_params_per_token": active,
        "expert_param_bytes_per_rank": 4 * held["experts"],
        "expert_gathered_bytes_per_layer": gathered_bytes,
        "state_bytes_per_rank_max": state,  # the runs' field
        "state_bytes_per_rank": memory,
        "fits": memory <= args.gpu_memory_gib * GiB,
        "moe_layers": n_moe,
        "all_to_all_bytes_per_moe_layer": a2a_layer,
        "all_to_all_bytes_per_step_rank": a2a_step,
        "all_to_all_link": "intra_node" if ep <= args.gpus_per_node else "inter_node",
        "all_to_all_s": a2a_seconds,
        "compute_s": compute_seconds,
        **muon,
    }


def ep_main(args, cfg=None) -> None:
    """--n_experts, or a 🤗 MoE config: every (ep x dp / ep) layout of train_ep.py, one line each."""
    cfg = cfg or moe_config(args)
    args.peak_tflops = args.peak_tflops or PEAK_TFLOPS[args.mixed_precision]
    links = link_settings(args)
    eps = [args.ep_size] if args.ep_size else [e for e in range(1, args.world_size + 1) if not args.world_size % e]
    records = [plan_ep(cfg, args, ep, links) for ep in eps if not cfg.n_experts % ep]
    first = records[0]
    model = cfg.model_type if isinstance(cfg, HFShape) else args.model_size
    print(
        f"plan_layout: {model} model with {cfg.n_experts} experts, top-{cfg.top_k}, in "
        f"{first['moe_layers']} of {cfg.n_layer} blocks: {first['total_params'] / 1e6:.2f}M parameters, "
        f"{first['active_params_per_token'] / 1e6:.2f}M active per token; {args.world_size} data-parallel ranks, "
        f"{args.batch_size} samples of {args.seq_len} tokens each, {args.optimizer}\n"
    )
    muon = args.optimizer == "muon"
    print(
        f"{'ep':>4} {'dp/ep':>6} {'experts/rank':>12} {'expert MiB':>10} {'gathered MiB':>12} {'state GiB':>9} "
        f"{'fits':>4} {'a2a MiB/step':>12} {'a2a ms':>8} {'compute ms':>10}"
        + (f" {'Muon MiB':>8} {'Muon ms':>8}" * muon)
    )
    for r in records:
        print(
            f"{r['ep']:>4} {r['expert_slices']:>6} {r['experts_per_rank']:>12} "
            f"{r['expert_param_bytes_per_rank'] / MiB:>10.2f} {r['expert_gathered_bytes_per_layer'] / MiB:>12.2f} "
            f"{r['state_bytes_per_rank'] / GiB:>9.3f} "
            f"{'yes' if r['fits'] else 'NO':>4} {r['all_to_all_bytes_per_step_rank'] / MiB:>12.3f} "
            f"{r['all_to_all_s'] * 1e3:>8.3f} {r['compute_s'] * 1e3:>10.3f}"
            + (
                f" {r['muon']['received_mib_rank0']:>8.2f} {(r['optimizer_s'] + r['newton_schulz_s']) * 1e3:>8.3f}"
                if muon
                else ""
            )
        )
    print(
        "experts/rank: those a rank computes (E / ep); expert MiB: the expert weights it keeps (cut over ep, then over "
        "dp / ep); gathered MiB: one MoE layer's E / ep experts, whole while it computes\n"
        "state: parameters + gradients + optimizer state per rank, plus one MoE layer's gathered experts and their "
        "gradients (activations not counted); a2a: all-to-all bytes "
        "each rank sends per step (tokens x top_k x n_embd x bytes x 2, forward and backward; (ep-1)/ep leaves it)"
        + (
            "\nMuon: what rank 0 receives to make the cut matrices whole (gathers and scatters over FSDP's groups), "
            "and their time plus its Newton–Schulz iterations' (fp32), after the backward"
            if muon
            else ""
        )
    )
    if args.json:
        print(json.dumps(records))


def lora_line(params: list[dict], n_params: int, args) -> str:
    """The header's line under LoRA: what trains, of what."""
    if not args.lora_r:
        return ""
    adapters = [p for p in params if p.get("trains")]
    n_train = sum(math.prod(p["shape"]) for p in adapters)
    layers = list(dict.fromkeys(p["name"].rsplit(".", 3)[0].rsplit(".", 1)[-1] for p in adapters))
    return (
        f"\n  LoRA r={args.lora_r}: {n_train:,} of {n_params:,} parameters train ({100 * n_train / n_params:.2f}%), "
        f"adapters on {len(adapters) // 2} linear layers ({', '.join(layers)}), the base frozen"
    )


def check_lora_args(args) -> None:
    """--lora_r and --lora_target_modules as the scripts take them (common/cli.py's check_lora_args); the
    targets are checked against the model (lora_parameters)."""
    if args.lora_r is None:
        if args.lora_target_modules is not None:
            raise UsageError("--lora_target_modules needs --lora_r: give the adapters' rank, e.g. --lora_r 8")
    elif args.lora_r < 1:
        raise UsageError(f"--lora_r must be at least 1 (got {args.lora_r}); leave it out to train every weight")
    elif args.n_experts:
        raise UsageError(
            "--lora_r: --n_experts plans train_ep.py's layouts, which count no LoRA adapters: plan it without --lora_r"
        )


def check_optimizer_args(args) -> None:
    """--optimizer and --ns_steps as the scripts take them (common/cli.py's checks), dense or MoE."""
    if args.optimizer not in ("adamw", "sgd", "muon"):
        raise UsageError(f"--optimizer {args.optimizer!r} is not supported: use adamw, sgd or muon")
    if args.ns_steps < 1:
        raise UsageError(f"--ns_steps must be at least 1 (got {args.ns_steps}): Newton–Schulz needs one iteration")


def main():
    args = build_args().parse_args()
    check_optimizer_args(args)
    check_lora_args(args)
    hf = hf_model(args) if args.model_config else None  # a 🤗 config, built on the meta device
    if args.n_experts or (hf and hf.n_experts):  # a mixture of experts: train_ep.py's layouts (experts over ep)
        return ep_main(args, hf)
    cfg = check_args(args, hf)
    links = link_settings(args)
    params, n_params = (hf.params, hf.n_params) if hf else model_parameters(cfg, args.lora_r, args.lora_target_modules)
    fixed = {d: getattr(args, d) for d in DIMS}

    valid, reasons = [], {}
    for layout in candidate_layouts(args.world_size // args.cp_size, fixed):
        layout.cp, layout.world_size = args.cp_size, args.world_size  # CP: each sequence cut over cp ranks
        try:
            run_args = layout_args(layout, args)
        except UsageError as e:
            reasons[describe(layout.describe())] = str(e)
            continue
        reason = why_invalid(layout, cfg, run_args)
        if reason:
            reasons[describe(layout.describe())] = reason
        else:
            valid.append((layout, run_args))
    if not valid:
        example = next(iter(reasons.values()), "")
        raise UsageError(
            f"no layout of --world_size {args.world_size} can run this model ({len(reasons)} tried; e.g. {example})"
        )
    records = sorted(
        (plan_layout(cfg, params, n_params, layout, run_args, links) for layout, run_args in valid), key=ranking_key
    )
    for rank, record in enumerate(records, 1):
        record["rank"] = rank
    given = all(v is not None for v in fixed.values())
    if given:
        fixed_layout = {d: fixed[d] for d in DIMS}
        records.sort(key=lambda r: r["layout"] != fixed_layout)  # the given layout first, then the ranking

    fitting = sum(r["fits"] for r in records)
    batch_line = (
        f"{args.global_batch_size} samples per step in all"
        if args.global_batch_size
        else f"{args.batch_size} samples per data-parallel rank"
    )
    model = (
        hf.describe()
        if hf
        else (
            f"{args.model_size} model, {n_params / 1e9:.3f}B parameters ({cfg.n_layer} layers x "
            f"{cfg.n_embd} wide, {cfg.n_head} heads)"
        )
    )
    print(
        f"plan_layout: {model}, {args.world_size} GPUs in nodes of {args.gpus_per_node}, "
        f"{args.gpu_memory_gib:g} GiB each\n"
        f"  step: {batch_line} of {args.seq_len} tokens in {args.n_microbatches} "
        f"micro-batches, schedule {args.schedule}, {args.optimizer}, mixed precision {args.mixed_precision}, "
        f"activation checkpointing {'on' if args.activation_checkpointing else 'off'}\n"
        f"  roofline: {args.peak_tflops:g} TFLOP/s peak; links "
        + ", ".join(f"{k} {v['bandwidth_GBps']:g} GB/s + {v['latency_us']:g} us" for k, v in links.items())
        + lora_line(params, n_params, args)
        + f"\n  {len(records)} valid layouts ({len(reasons)} others cannot run this model), {fitting} fit\n"
    )
    print(table(records, args.top, given))
    if args.top and len(records) > args.top:
        print(f"... {len(records) - args.top} more (--top 0 shows all)")
    print(
        "state: parameters + gradients + optimizer state of the largest rank"
        + (" (LoRA: gradients and optimizer state of the adapters only)" if args.lora_r else "")
        + "; activ.: activations in flight, logits and recomputation; total adds FSDP's gathered copies; comm: rank "
        "0's collectives per step"
    )
    if args.json:
        print(json.dumps(records))


if __name__ == "__main__":
    run_main(main)
