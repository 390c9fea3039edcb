"""``strategy="dp"``: synchronous data parallel (replicated model, bucketed all-reduce),
and ``strategy="tp"``, the same engine with its layers split over every worker."""

from paratrain.parallel.dp.description import DataParallelStrategy, TensorParallelStrategy
from paratrain.parallel.dp.engine import DataParallelEngine
from paratrain.parallel.dp.tp import TensorParallelEngine

__all__ = [
    "DataParallelEngine",
    "DataParallelStrategy",
    "TensorParallelEngine",
    "TensorParallelStrategy",
]
