"""A 🤗 model's pipeline stages, read from its own config (config.base_model_pp_plan): which parts
come before and after its decoder layers (hf_pipeline_parts), and a stage that runs some of its
layers through the family's own forward (HFPipelineStage). Imported only when a 🤗 model runs under
PP (train_pp.py's stage_modules).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.nn as nn

from .errors import UsageError
from .hf import check_untied


class HFPipelineParts(NamedTuple):
    """A 🤗 model's parts in pipeline order, named as its own forward reads them: the base model's
    children before its decoder layers (embedding, embedding dropout), the layers' path from the
    root, the children after them (final norm), and the output layer, a child of the root."""

    before: tuple[str, ...]
    layers: str
    after: tuple[str, ...]
    head: str


def hf_pipeline_parts(model: nn.Module) -> HFPipelineParts:
    """From the family's base_model_pp_plan: llama {embed_tokens, layers, norm}, gpt_neox {embed_in,
    emb_dropout, layers, final_layer_norm}; the output layer is get_output_embeddings() (lm_head).
    A family without a plan, or with weights outside it, is refused: no stage would run them."""
    c, family, base = model.config, model.config.model_type, model.base_model
    plan = list(getattr(c, "base_model_pp_plan", None) or {})
    lists = [name for name in plan if isinstance(getattr(base, name, None), nn.ModuleList)]
    if len(lists) != 1:
        raise UsageError(
            f"--pp_size: {family} has no pipeline plan with one list of decoder layers in "
            f"transformers (config.base_model_pp_plan: {plan or 'empty'}), so nothing says which "
            "parts come before and after its layers: train it with train_fsdp.py"
        )
    cut = plan.index(lists[0])
    head = model.get_output_embeddings()
    head_name = next((n for n, m in model.named_children() if m is head), None) if head is not None else None
    outside = [n for n, m in base.named_children() if n not in plan and any(True for _ in m.parameters())]
    outside += [
        f"{n} (beside the base model)"
        for n, m in model.named_children()
        if m is not base and n != head_name and any(True for _ in m.parameters())
    ]
    if head_name is None or outside:
        held = f"holds {', '.join(outside)} outside" if outside else "has no output layer among the children of"
        raise UsageError(
            f"--pp_size: {family} {held} its pipeline plan ({', '.join(plan)}, then the output "
            "layer), so no stage would run it: train it with train_fsdp.py"
        )
    prefix = f"{model.base_model_prefix}." if model.base_model_prefix else ""
    return HFPipelineParts(tuple(plan[:cut]), prefix + lists[0], tuple(plan[cut + 1 :]), head_name)


def hf_stage_modules(model: nn.Module, stages: list[tuple[range, bool, bool]]) -> list[nn.Module]:
    """train_pp.py's stage_modules for a 🤗 model of any family: its parts in the order of its own
    pipeline plan, each stage running the family's own forward (HFPipelineStage). The embedding is
    dropped where this rank holds no first stage, the final norm and output layer where it holds no
    last; a tied head would be the embedding of another rank (refused)."""
    holds_first, holds_last = any(first for _, first, _ in stages), any(last for _, _, last in stages)
    parts = hf_pipeline_parts(model)
    if not (holds_first and holds_last):
        check_untied(model, "pipeline parallelism")
    base = model.base_model
    for name in () if holds_first else parts.before:
        setattr(base, name, None)  # the embedding (and dropout): freed; the TP plan skips it
    if not holds_last:
        for name in parts.after:
            setattr(base, name, None)  # the final norm
        setattr(model, parts.head, None)  # the output layer
    return [HFPipelineStage(model, parts, units, first, last) for units, first, last in stages]


class PassThrough(nn.Module):
    """Stands in, during one stage's forward, for a part another stage runs (a decoder layer, the
    embedding's dropout, the final norm): returns the hidden states it is given, whatever else the
    family's forward passes it (masks, rotary cos/sin, the cache)."""

    def forward(self, hidden_states=None, *args, **kwargs):
        return hidden_states


PASS_THROUGH = PassThrough()


class HFPipelineStage(nn.Module):
    """One pipeline stage of a 🤗 model: some of its decoder layers, run by the family's own forward,
    so each layer gets the mask of its own kind (full, sliding window: config.layer_types, by its
    index in the model), its rotary cos/sin, Gemma's scaled embedding, gpt-oss's sinks... For the
    call, every part this stage does not run is a PassThrough; then the model is put back as it was
    (this rank's other stages, and None for what was dropped: the TP plan and the checkpoints see
    the model's own names). Input: token ids on the first stage, else hidden states (batch, seq,
    hidden), given as inputs_embeds; output: the last decoder layer's hidden states, or the logits
    on the last stage (the family's whole head: final norm, output layer, soft-capping). It
    registers only what it runs (its FSDP root, the PipelineStage's parameters); the model is not a
    submodule, since it holds the other stages' parts."""

    def __init__(self, model: nn.Module, parts: HFPipelineParts, layers: range, is_first: bool, is_last: bool):
        super().__init__()
        self.__dict__["whole"] = model  # not registered: see above
        self.parts, self.layer_ids, self.is_first, self.is_last = parts, set(layers), is_first, is_last
        base, units = model.base_model, model.get_submodule(parts.layers)
        self.layers = nn.ModuleDict({str(i): units[i] for i in layers})
        ends = (parts.before if is_first else ()) + (parts.after if is_last else ())
        self.ends = nn.ModuleDict({name: getattr(base, name) for name in ends if getattr(base, name) is not None})
        self.head = getattr(model, parts.head) if is_last else None

    @contextmanager
    def running_alone(self):
        """For the call: every part of the model this stage does not run is a PassThrough."""
        base, units = self.whole.base_model, self.whole.get_submodule(self.parts.layers)
        slots = [(units, str(i)) for i in range(len(units)) if i not in self.layer_ids]
        slots += [(base, name) for name in (() if self.is_first else self.parts.before)]
        slots += [(base, name) for name in (() if self.is_last else self.parts.after)]
        saved = [owner._modules[name] for owner, name in slots]
        for owner, name in slots:
            owner._modules[name] = PASS_THROUGH
        try:
            yield
        finally:
            for (owner, name), module in zip(slots, saved, strict=True):
                owner._modules[name] = module

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None):
        inputs = {"input_ids": x} if self.is_first else {"inputs_embeds": x}  # embedding: stage 0
        with self.running_alone():  # --document_mask: position_ids travel on with the hidden states
            if self.is_last:
                return self.whole(**inputs, position_ids=position_ids).logits
            hidden = self.whole.base_model(**inputs, position_ids=position_ids).last_hidden_state
        return hidden if position_ids is None else (hidden, position_ids)
