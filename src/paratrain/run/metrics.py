"""What the trainer reads off the predictions: summed loss, correct answers, samples counted.

Each metric returns sums over the rows it was given, leaving out padding rows (targets
``IGNORE_INDEX``), so that a tally over any split of the batches, added over the workers,
divides once into the exact figure over every sample counted (see
``paratrain.parallel.metric_tally``). The summed loss is the reference models' own loss
(``F.cross_entropy``, the mean of which ``loss_for`` trains with), as a sum: an evaluation
whose last batch is padded cannot take the engines' batch means, which would average
the padding's empty shares in.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from paratrain.losses import _logits
from paratrain.parallel.metric_tally import IGNORE_INDEX

__all__ = ["ClassificationSums", "TokenSums", "metric_for"]


def _flat(outputs: Any, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = _logits(outputs).float()
    return logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).to(logits.device)


class ClassificationSums:
    """``(loss_sum, correct, count)``: cross-entropy summed over the counted samples, how
    many of them the argmax predicts right, and how many were counted."""

    fields = ("loss_sum", "correct", "count")

    def __call__(self, outputs: Any, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits, labels = _flat(outputs, targets)
        counted = labels != IGNORE_INDEX
        loss = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
        correct = (logits.argmax(dim=-1) == labels) & counted
        return loss, correct.sum(), counted.sum()


class TokenSums:
    """``(loss_sum, count)`` over the counted next-token predictions (``gpt``)."""

    fields = ("loss_sum", "count")

    def __call__(self, outputs: Any, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits, labels = _flat(outputs, targets)
        loss = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
        return loss, (labels != IGNORE_INDEX).sum()


def metric_for(kind: str) -> ClassificationSums | TokenSums:
    """The metric of a dataset kind: accuracy too for ``classification``."""
    return ClassificationSums() if kind == "classification" else TokenSums()
