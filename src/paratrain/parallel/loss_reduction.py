"""What ``loss_fn`` returns, and how an engine makes it the loss of the whole global batch.

A loss that is a mean over its micro-batch (``F.cross_entropy`` on class labels, MSE) is
exact under any split as long as every part holds the same number of samples: the mean of
equal parts' means is the mean of the whole. A token-mean loss with ignored labels
(padding marked -100, spread unevenly over the batch) is not: each part's mean divides by
its own count of real tokens, so averaging the parts weighs a token in a sparse part more
than one in a dense part. That is the loss-normalisation defect other trainers have had
under gradient accumulation, and it would make the result depend on the device count.

So ``loss_fn`` may instead return a pair ``(loss_sum, count)``, the loss summed over the
elements it counts and how many it counted, and offer ``loss_fn.count(targets)``, the
count of any batch's targets (``paratrain.losses`` has such losses). Every rank holds the
global batch, so each counts the global batch's elements N before its first backward, with
no message, and backpropagates each part's ``loss_sum / N``: the same scalar, scaled at the
same point, as one device's ``(sum over the whole batch) / N``, so the gradients summed
over parts are the plain loop's to the last bit on one process. ``StepStats.loss`` is the
global ``sum / N``; the pair's own count is checked against ``count`` on this worker's share.
"""

from __future__ import annotations

from typing import Any

import torch


class LossReturnError(TypeError):
    """``loss_fn`` returned something the engines cannot make a global-batch loss of."""


def split_loss(result: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(value, count)``: ``(mean, None)`` for a scalar loss, ``(sum, count)`` for a pair."""
    if isinstance(result, torch.Tensor) and result.numel() == 1:
        return result.reshape(()), None
    if isinstance(result, tuple) and len(result) == 2:
        total, count = result
        if isinstance(total, torch.Tensor) and total.numel() == 1:
            return total.reshape(()), torch.as_tensor(count).reshape(())
    raise LossReturnError(
        "loss_fn must return a scalar tensor (the mean over its samples) or a pair "
        "(loss summed over the counted elements, their count), not "
        f"{type(result).__name__}; see paratrain.parallel.loss_reduction."
    )


def count_of(loss_fn: Any, targets: Any) -> int | None:
    """``loss_fn.count(targets)`` where the loss offers it (summed losses), else None."""
    counter = getattr(loss_fn, "count", None)
    return None if counter is None else int(counter(targets))


class LossTotals:
    """One worker's step: the loss of each part it runs, added up, and each part's factor.

    ``parts`` is how many equal parts the global batch is cut into (micro-batches times
    replicas): a mean loss is divided by ``parts``. ``averaged_by`` is how many workers'
    gradients are then averaged rather than summed (ps servers average their workers'
    pushes): a summed loss is divided by ``N / averaged_by``.
    """

    def __init__(
        self,
        loss_fn: Any,
        targets: Any,
        share_targets: Any,
        *,
        parts: int,
        averaged_by: int = 1,
        device: torch.device,
    ) -> None:
        self.global_count = count_of(loss_fn, targets)
        self._share_count = count_of(loss_fn, share_targets) if share_targets is not None else None
        self.parts, self.averaged_by = parts, averaged_by
        self.value = torch.zeros((), device=device)
        self.counted = 0
        self.summed: bool | None = None

    @property
    def divisor(self) -> float:
        """What each part's loss is divided by before backward (a division, as the plain
        loop's ``sum / N``, so that the gradients agree to the last bit)."""
        if self.summed:
            return self.global_count / self.averaged_by
        return float(self.parts)

    def add(self, result: Any) -> torch.Tensor:
        """Record one part's ``loss_fn`` result; returns its loss (a mean or a sum), to be
        divided by ``divisor`` before backward."""
        value, count = split_loss(result)
        summed = count is not None
        if self.summed is None:
            if summed and self.global_count is None:
                raise LossReturnError(
                    "loss_fn returns (sum, count) but has no count(targets) method, so the "
                    "global batch's count is unknown before backward; add one (see "
                    "paratrain.losses.token_cross_entropy) or return the mean."
                )
            self.summed = summed
        elif self.summed != summed:
            raise LossReturnError(
                "loss_fn returned a (sum, count) pair for one micro-batch and a scalar for "
                "another; return the same form for every batch."
            )
        self.value += value.detach().float()
        if summed:
            self.counted += int(count)
        return value

    def scaled(self, loss: torch.Tensor, mean_factor: float, loss_scale: float) -> torch.Tensor:
        """The part's loss ready for backward: a sum divided by the count (then times the
        fp16 ``loss_scale``); a mean times the engine's ``mean_factor`` (its equal-parts
        factor times the loss scale, as the engine always computed it)."""
        if self.summed:
            divided = loss / self.divisor
            return divided if loss_scale == 1.0 else divided * loss_scale
        return loss if mean_factor == 1.0 else loss * mean_factor

    def contribution(self) -> torch.Tensor:
        """This worker's share of the step's loss, each part divided by ``divisor``: the
        replicas' (or averaged workers') contributions add up to the global loss."""
        self._check_counts()
        return self.value / self.divisor

    def _check_counts(self) -> None:
        if self.summed and self._share_count is not None and self.counted != self._share_count:
            raise LossReturnError(
                f"loss_fn counted {self.counted} elements in this worker's share, but its "
                f"count(targets) says {self._share_count}; make the two agree."
            )


def loss_value(result: Any) -> float:
    """A whole batch's loss from one ``loss_fn`` result (evaluation on one worker)."""
    value, count = split_loss(result)
    return float(value) if count is None else float(value / count)
