"""Parallel strategies behind one Engine interface; importing registers them all."""

from paratrain.parallel import (  # noqa: F401  (registration)
    data_parallel,
    parameter_server,
    pipeline,
    single,
    zero,
)
from paratrain.parallel.batching import BatchSplitError
from paratrain.parallel.strategy import Engine, StepStats, create_engine, strategy_names

__all__ = ["BatchSplitError", "Engine", "StepStats", "create_engine", "strategy_names"]
