"""The Task of any causal language model over batches of {"input_ids", "labels"} (labels aligned with
the inputs, -100 = not a target): the built-in GPT's (common/model.py) and 🤗 models' (common/hf.py)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .errors import UsageError
from .task import Task


class CausalLMTask(Task):
    """Next-token prediction over {"input_ids", "labels"} batches; position t predicts t+1.
    Outputs are logits (B, T, vocab), or a 🤗 output object holding them (`.logits`)."""

    name = "causal_lm"

    def __init__(self, seq_len: int, data_task: str = "text"):
        self.tokens_per_sample = seq_len
        self.data_task = data_task  # "addition": exact match is reported; "text": perplexity

    def inputs(self, batch) -> tuple:
        """The token ids; with --document_mask also their positions in their documents (position_ids)."""
        if "position_ids" in batch:
            return batch["input_ids"], batch["position_ids"]
        return (batch["input_ids"],)

    def check(self, model: nn.Module, batch) -> None:
        """With --document_mask: the model keeps documents apart (check_documents_apart)."""
        if "position_ids" in batch:
            self.check_documents_apart(model, batch["input_ids"].device)

    @torch.no_grad()
    def check_documents_apart(self, model: nn.Module, device=None) -> None:
        """A packed block's later document must not see the one before it: on a row of two documents (random
        bytes), other tokens in the first leave the logits of the second unchanged, or one line (a model whose
        forward does not mask by position_ids, which transformers' gpt-oss does not)."""
        n = min(16, self.tokens_per_sample or 16)
        device = device or next(model.parameters()).device
        ids = torch.randint(256, (1, n), generator=torch.Generator().manual_seed(0)).to(device)
        positions = torch.cat([torch.arange(n // 2), torch.arange(n - n // 2)])[None].to(device)
        cut = n // 2
        row = {"input_ids": ids, "position_ids": positions}
        was_training = model.training
        model.eval()
        try:
            a = _whole(logits_of(model(*self.inputs(row))))
            other = ids.clone()
            other[:, :cut] = (ids[:, :cut] + 1) % a.shape[-1]  # other tokens in the first document only
            b = _whole(logits_of(model(*self.inputs(row | {"input_ids": other}))))
        finally:
            model.train(was_training)
        a, b = a[:, cut:], b[:, cut:]
        diff = (a - b).abs().max().item()
        if diff > 1e-5:
            family = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
            raise UsageError(
                f"--document_mask: {family} attends across the documents of a packed block (the second document's "
                f"logits move by {diff:.2g} when only the first one's tokens change): its forward does not mask "
                "by position_ids; train it without --document_mask"
            )

    def flops_per_item(self, n_params: int) -> float:
        return 6 * n_params  # forward + backward matmuls per token (attention scores left out)

    def targets(self, batch):
        return batch["labels"]

    def count_targets(self, batch) -> torch.Tensor:
        return (batch["labels"][:, 1:] != -100).sum()

    def next_token_targets(self, batch) -> torch.Tensor:
        """(B, T): the label each position predicts (that of the next token; -100 none), so that the
        sequence can be cut anywhere (context parallelism) and each piece still knows its targets."""
        return F.pad(batch["labels"][:, 1:], (0, 1), value=-100)

    def loss_at(
        self, model: nn.Module, input_ids, next_targets, positions, documents=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss_sum, n_targets) of some tokens of each sequence (context parallelism: this rank's slice),
        run at their real `positions` (Task.forward_at), against their `next_token_targets`; `documents`:
        the whole sequences' document ids under --document_mask (Task.forward_at gives them to the attention)."""
        args = (model, input_ids, positions) if documents is None else (model, input_ids, positions, documents)
        logits = logits_of(self.forward_at(*args))
        loss_sum = F.cross_entropy(
            logits.reshape(-1, logits.size(-1)).float(), next_targets.reshape(-1), ignore_index=-100, reduction="sum"
        )
        return loss_sum, (next_targets != -100).sum()

    def loss(self, outputs, targets):
        return cross_entropy_sum(logits_of(outputs), targets)

    def eval_sums(self, outputs, targets) -> dict:
        logits = logits_of(outputs)[:, :-1]
        targets = targets[:, 1:]
        is_target = targets != -100
        loss_sum = F.cross_entropy(logits.transpose(1, 2).float(), targets, ignore_index=-100, reduction="sum")
        # exact match: argmax right at every target position (greedy decoding then follows the same path)
        correct = ((logits.argmax(-1) == targets) | ~is_target).all(dim=1)
        return {"loss": loss_sum, "targets": is_target.sum(), "correct": correct.sum()}

    def eval_metrics(self, sums: dict) -> dict:
        eval_loss = sums["loss"] / sums["targets"]
        if self.data_task == "addition":
            return {"eval_loss": eval_loss, "exact_match": sums["correct"] / sums["samples"]}
        return {"eval_loss": eval_loss, "perplexity": round(math.exp(min(eval_loss, 50)), 4)}


def _whole(logits):
    return logits.full_tensor() if hasattr(logits, "full_tensor") else logits  # loss parallel: vocabulary shards


def documents_of(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) document ids from (B, T) positions in their documents: a document starts wherever a position
    does not follow the one before (0 after anything), the rule transformers applies to packed sequences."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts.cumsum(-1)


def document_causal_mask(documents: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool: a token attends to the tokens before it, itself included, in its own document."""
    T = documents.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=documents.device).tril()
    return (documents[:, None, :, None] == documents[:, None, None, :]) & causal


def logits_of(outputs) -> torch.Tensor:
    return getattr(outputs, "logits", outputs)


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token loss and the number of targets it covers.

    `labels` is aligned with the inputs (-100 = not a target); position t predicts t+1.
    Returning a sum, not a mean, lets the caller divide by the target count of the whole
    optimizer step (all micro-batches, all ranks): per-batch means would weight tokens
    unequally when batches hold different numbers of targets.
    """
    shift_logits = logits[:, :-1].reshape(-1, logits.size(-1)).float()
    shift_labels = labels[:, 1:].reshape(-1)
    loss_sum = F.cross_entropy(shift_logits, shift_labels, ignore_index=-100, reduction="sum")
    return loss_sum, (shift_labels != -100).sum()
