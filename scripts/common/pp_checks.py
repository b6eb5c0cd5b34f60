"""train_pp.py's refusals, one line each, before anything is cut: a --pp_size that is not every
process (check_pp_size), stages that, chained, do not compute the whole model
(check_stages_compute). The pipeline flags against the layout and the model are common/pipeline.py's
(check_pipeline_layout). And --pp_size's help (PP_SIZE_HELP).
"""

from __future__ import annotations

import sys

import torch
import torch.nn as nn

from .errors import UsageError

PP_SIZE_HELP = "pipeline ranks: every process (-1, or their number); dp x pp is train_hybrid.py's"


def check_pp_size(pp_size: int, world: int) -> None:
    """One strategy per file: every process is one pipeline rank; dp x pp is train_hybrid.py's."""
    if pp_size not in (-1, world):
        raise UsageError(
            f"--pp_size {pp_size} on {world} processes: train_pp.py is pure pipeline parallel, "
            "every process one pipeline rank (drop --pp_size); pipelines trained data parallel "
            f"(dp x pp) are train_hybrid.py's: --pp_size N --dp_shard M, N x M = {world}"
        )


def check_stages_compute(model: nn.Module, ranges: list[range], stage_modules, n_tokens: int = 64) -> None:
    """Before any part is dropped: the stages chained give the whole model's logits, on a few tokens
    (eval mode, no gradients, the global RNG untouched). Proof, for any 🤗 family, that its forward
    does nothing to the hidden states between the parts of its pipeline plan that a stage would miss
    or repeat (a family that does is refused, one line). Other models are not checked here: the
    built-in GPT's stages are its own embed/head code, a model of one's own has the cut check.
    `stage_modules`: train_pp.py's MODEL section's builder, given every stage."""
    transformers = sys.modules.get("transformers")  # not imported: no 🤗 model runs
    c = getattr(model, "config", None)
    is_hf = transformers is not None and isinstance(model, transformers.PreTrainedModel)
    if not is_hf or not hasattr(c, "vocab_size"):
        return
    stages = stage_modules(model, [(r, s == 0, s == len(ranges) - 1) for s, r in enumerate(ranges)])
    device = next(model.parameters()).device
    n_tokens = min(n_tokens, getattr(c, "max_position_embeddings", None) or n_tokens)
    ids = torch.randint(c.vocab_size, (2, n_tokens), generator=torch.Generator().manual_seed(0)).to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            whole, x = model(input_ids=ids).logits, ids
            for stage in stages:
                x = stage(x)
    finally:
        model.train(was_training)
    diff = (whole - x).abs().max().item() if x.shape == whole.shape else float("inf")
    if not diff <= 1e-5:
        raise UsageError(
            f"--pp_size: {c.model_type}'s {len(ranges)} pipeline stages, chained, do not give the "
            f"whole model's logits (max |diff| {diff:.2g} on {n_tokens} tokens): its forward does "
            "more to the hidden states than the parts of its pipeline plan "
            "(config.base_model_pp_plan) hold; train it with train_fsdp.py"
        )
