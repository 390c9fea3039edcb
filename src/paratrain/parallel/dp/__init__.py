"""``strategy="dp"``: synchronous data parallel (replicated model, bucketed all-reduce)."""

from paratrain.parallel.dp.engine import DataParallelEngine

__all__ = ["DataParallelEngine"]
