"""Parallel strategies behind one Engine interface; importing registers them all."""

from paratrain.parallel import data_parallel, pipeline, single  # noqa: F401  (registration)
from paratrain.parallel.batching import BatchSplitError
from paratrain.parallel.strategy import Engine, StepStats, create_engine, strategy_names

__all__ = ["BatchSplitError", "Engine", "StepStats", "create_engine", "strategy_names"]
