"""``paratrain.setup``: the one call that turns a model into an engine for a strategy."""

from __future__ import annotations

from typing import Any

from torch import nn

from paratrain.parallel import Engine, create_engine
from paratrain.parallel.strategy import LossFn, OptimizerFactory

AUTO = "auto"
ENGINE_ONLY = ("max_grad_norm", "memory_per_device")
"""Options every engine takes that the planner does not search: passed on as they are."""


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

    ``strategy="auto"`` plans first (``paratrain.plan``, inside the job: every worker gets
    the same answer) from ``global_batch=`` and ``sample=(inputs, targets)``, within
    ``memory_per_device`` if given; any other option given is kept fixed. The engine's
    ``plan`` attribute holds the choice and its prediction.
    """
    if strategy == AUTO:
        return _planned_engine(
            model,
            optimizer=optimizer,
            loss_fn=loss_fn,
            gradient_accumulation=gradient_accumulation,
            **options,
        )
    return create_engine(
        strategy,
        model,
        optimizer=optimizer,
        loss_fn=loss_fn,
        gradient_accumulation=gradient_accumulation,
        **options,
    )


def _planned_engine(
    model: nn.Module,
    *,
    optimizer: OptimizerFactory,
    loss_fn: LossFn,
    gradient_accumulation: int,
    global_batch: int | None = None,
    sample: Any = None,
    precision: str = "fp32",
    **options: Any,
) -> Engine:
    """``setup(strategy="auto")``: plan in the job, then build the chosen engine."""
    from paratrain.planner import plan_in_job

    if global_batch is None or sample is None:
        raise ValueError(
            "strategy='auto' plans from the global batch and a sample of it: pass "
            "global_batch=<samples per step> and sample=(inputs, targets)."
        )
    kept = {key: options.pop(key) for key in ENGINE_ONLY if key in options}
    chosen = plan_in_job(
        model,
        global_batch=global_batch,
        optimizer=optimizer,
        loss_fn=loss_fn,
        sample=sample,
        memory_per_device=kept.get("memory_per_device"),
        precision=precision,
        gradient_accumulation=gradient_accumulation,
        **options,
    )
    # the plan's options include the fixed ones (a tp_plan among them) as setup takes them
    engine = create_engine(
        chosen.strategy, model, optimizer=optimizer, loss_fn=loss_fn, **chosen.options, **kept
    )
    engine.plan = chosen
    return engine
