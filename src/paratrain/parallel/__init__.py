"""Parallel strategies: a description each (before workers exist) and an engine each
(what runs); importing registers them all.

The shared pieces (the contracts, the Layout, batching, precision, recompute, memory tracking,
checkpoint hooks, the split layers of ``tensor``) sit here; each strategy is a package of
its own (``dp``, with ``tp``, dp's layers split over every worker; ``zero``; ``pipeline``;
``ps``) and the reference ``single`` is one module.
"""

from paratrain.parallel import dp, pipeline, ps, single, zero  # noqa: F401  (registration)
from paratrain.parallel.batching import BatchSplitError
from paratrain.parallel.description import Strategy
from paratrain.parallel.layout import Layout, LayoutError
from paratrain.parallel.options import RunSpec, StrategyOption
from paratrain.parallel.registry import (
    declared_options,
    default_strategy,
    strategy_class,
    strategy_names,
)
from paratrain.parallel.strategy import Engine, StepStats, create_engine

__all__ = [
    "BatchSplitError",
    "Engine",
    "Layout",
    "LayoutError",
    "RunSpec",
    "StepStats",
    "Strategy",
    "StrategyOption",
    "create_engine",
    "declared_options",
    "default_strategy",
    "strategy_class",
    "strategy_names",
]
