"""The keywords every engine takes, as one checked object.

Every strategy's constructor accepts the same six settings besides the model (the
optimizer factory, the loss, gradient accumulation, precision, the memory budget and
gradient clipping). They used to be restated, defaults and all, in each constructor and
passed down by hand; now a strategy's ``__init__`` names only its own options and hands
the rest on as ``**shared``, and ``Engine.__init__`` checks them once, here, into an
``EngineSettings`` it keeps as ``engine.settings``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paratrain.parallel.clipping import check_max_grad_norm
from paratrain.parallel.precision import Precision

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass(frozen=True)
class EngineSettings:
    """The shared keywords, checked: each refusal is one sentence saying what to pass."""

    optimizer: OptimizerFactory
    """A factory over this worker's parameters (the strategy decides which they are)."""
    loss_fn: LossFn
    """``loss_fn(outputs, targets)``: a mean, or ``(sum, count)`` (see ``loss_reduction``)."""
    gradient_accumulation: int = 1
    """Micro-batches a replica's share is cut into per optimizer step."""
    precision: str | Precision = "fp32"
    """"fp32", "bf16", "fp16" or a ``Precision``."""
    memory_per_device: str | int | None = None
    """The worker's memory budget ("2GiB", bytes), or None for no budget."""
    max_grad_norm: float | None = None
    """Clip the global gradient norm to this, or None."""

    def __post_init__(self) -> None:
        if not callable(self.optimizer) or isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(
                "optimizer must be a factory such as `lambda params: torch.optim.Adam(params)`, "
                "because the strategy decides which parameters each worker optimizes."
            )
        if not callable(self.loss_fn):
            raise TypeError("loss_fn must be callable as loss_fn(outputs, targets) -> mean loss.")
        accumulation = self.gradient_accumulation
        if not isinstance(accumulation, int) or accumulation < 1:
            raise ValueError(
                f"gradient_accumulation must be a positive integer, not {accumulation!r}."
            )
        object.__setattr__(self, "max_grad_norm", check_max_grad_norm(self.max_grad_norm))
