"""``paratrain.setup``: the one call that turns a model into an engine for a strategy."""

from __future__ import annotations

from typing import Any

from torch import nn

from paratrain.parallel import Engine, create_engine
from paratrain.parallel.strategy import LossFn, OptimizerFactory


def setup(
    model: nn.Module,
    *,
    optimizer: OptimizerFactory,
    loss_fn: LossFn,
    strategy: str = "dp",
    gradient_accumulation: int = 1,
    **options: Any,
) -> Engine:
    """Wrap ``model`` in the engine for ``strategy``; call it in every worker process.

    ``optimizer`` is a factory (``lambda params: torch.optim.Adam(params, lr=1e-3)``) because
    the strategy decides which parameters each worker optimizes. Strategy-specific options
    (``bucket_mb=...``, ...) are keyword arguments; an option the strategy does not know is
    refused with the list of those it accepts.
    """
    return create_engine(
        strategy,
        model,
        optimizer=optimizer,
        loss_fn=loss_fn,
        gradient_accumulation=gradient_accumulation,
        **options,
    )
