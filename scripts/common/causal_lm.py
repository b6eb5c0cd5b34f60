"""The Task of any causal language model over batches of {"input_ids", "labels"} (labels aligned with
the inputs, -100 = not a target): the built-in GPT's (common/model.py) and 🤗 models' (common/hf.py)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .task import Task


class CausalLMTask(Task):
    """Next-token prediction over {"input_ids", "labels"} batches; position t predicts t+1.
    Outputs are logits (B, T, vocab), or a 🤗 output object holding them (`.logits`)."""

    name = "causal_lm"

    def __init__(self, seq_len: int, data_task: str = "text"):
        self.tokens_per_sample = seq_len
        self.data_task = data_task  # "addition": exact match is reported; "text": perplexity

    def inputs(self, batch) -> tuple:
        return (batch["input_ids"],)

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

    def loss_at(self, model: nn.Module, input_ids, next_targets, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss_sum, n_targets) of some tokens of each sequence (context parallelism: this rank's slice),
        run at their real `positions` (Task.forward_at), against their `next_token_targets`."""
        logits = logits_of(self.forward_at(model, input_ids, positions))
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
