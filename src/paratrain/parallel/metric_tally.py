"""Sums of what a metric reads off each (outputs, targets) pair the loss sees, on any engine.

Every engine hands its forward's outputs to ``loss_fn(outputs, targets)``, whatever it
splits: a replica's share (dp, zero), a micro-batch at the last stage (pipeline), a
worker's share or the whole batch (ps). So a metric that needs the predictions (accuracy)
hooks in there, once for every engine, rather than in each engine's step: the engine's
``loss_fn`` is wrapped in :class:`ObservedLoss`, which hands each pair to the open
:class:`Tally` and returns the loss unchanged.

A metric returns SUMS (correct predictions, samples counted, summed loss), never means:
sums of parts add up to the sum of the whole however the batch was cut, so the global
figure is the parts' sums added over workers (``Engine.tally_totals``) and divided once,
exact, where a mean of the workers' means would weigh a small part as much as a big one.
Rows whose targets are ``IGNORE_INDEX`` are padding (the last, short evaluation batch made
whole) and a metric leaves them out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

IGNORE_INDEX = -100
"""Targets that mark padding rows: ``F.cross_entropy`` ignores them by default."""


class Metric(Protocol):
    """What a tally sums: ``fields`` names the sums, ``__call__`` returns one value each."""

    fields: tuple[str, ...]

    def __call__(self, outputs: Any, targets: Any) -> Sequence[torch.Tensor | float]: ...


class Tally:
    """Running sums of a metric's fields on this worker (float64: counts stay exact).

    Opened on an ``ObservedLoss`` it takes the pairs that loss sees until ``close`` (or
    the end of a ``with`` block), then hands them back to the tally open before it.
    """

    def __init__(self, metric: Metric, observed: ObservedLoss | None = None) -> None:
        self.metric = metric
        self.sums = torch.zeros(len(metric.fields), dtype=torch.float64)
        self._observed, self._previous = observed, None
        if observed is not None:
            self._previous, observed.tally = observed.tally, self

    def add(self, outputs: Any, targets: Any) -> None:
        values = self.metric(outputs, targets)
        if len(values) != len(self.metric.fields):
            raise ValueError(
                f"the metric returned {len(values)} values for its {len(self.metric.fields)} "
                f"fields {', '.join(self.metric.fields)}; return one value per field."
            )
        # Added where the metric computed them: no device-to-host wait per micro-batch.
        device = next((v.device for v in values if isinstance(v, torch.Tensor)), self.sums.device)
        row = torch.stack(
            [torch.as_tensor(v, dtype=torch.float64, device=device).reshape(()) for v in values]
        )
        if self.sums.device != row.device:
            self.sums = self.sums.to(row.device)
        self.sums += row

    def reset(self) -> None:
        self.sums.zero_()

    def close(self) -> None:
        """Stop taking pairs; the tally open before this one takes them again."""
        if self._observed is not None and self._observed.tally is self:
            self._observed.tally = self._previous
        self._observed = None

    def __enter__(self) -> Tally:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ObservedLoss:
    """``loss_fn`` as an engine calls it, also handing each pair to the open tally.

    Attributes of the wrapped loss (``count`` of a summed loss) read through, so the
    engines' loss reduction sees the loss it always saw.
    """

    def __init__(self, loss_fn: Any) -> None:
        self.inner = loss_fn
        self.tally: Tally | None = None

    def __call__(self, outputs: Any, targets: Any) -> Any:
        if self.tally is not None:
            with torch.no_grad():
                self.tally.add(_detached(outputs), targets)
        return self.inner(outputs, targets)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


def _detached(outputs: Any) -> Any:
    if isinstance(outputs, torch.Tensor):
        return outputs.detach()
    return outputs
