"""Splitting a global batch into per-replica shares and micro-batches.

Inputs and targets may be a tensor or a (nested) tuple/list/dict of tensors whose first
dimension is the batch (how they then reach the model: ``inputs.py``). A split that does
not come out even is refused with a sentence that names the sizes and what would work,
before any computation starts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class BatchSplitError(ValueError):
    """The global batch cannot be divided as the strategy needs."""


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to every tensor in a nested batch structure."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return {key: map_tensors(value, fn) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(value, fn) for value in batch)
    return batch


def batch_size(batch: Any) -> int:
    """Length of the first dimension shared by every tensor in ``batch``."""
    sizes: set[int] = set()

    def record(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() == 0:
            raise BatchSplitError("batch tensors need a batch dimension; got a 0-d tensor.")
        sizes.add(tensor.shape[0])
        return tensor

    map_tensors(batch, record)
    if not sizes:
        raise BatchSplitError("the batch holds no tensors.")
    if len(sizes) > 1:
        raise BatchSplitError(f"batch tensors disagree on the batch size: {sorted(sizes)}.")
    return sizes.pop()


def check_divisible(global_batch: int, *, replicas: int, micro_batches: int) -> int:
    """Return the per-micro-batch size, or refuse a batch that does not split evenly."""
    parts = replicas * micro_batches
    if global_batch % parts == 0 and global_batch >= parts:
        return global_batch // parts
    below = global_batch // parts * parts
    nearest = " or ".join(str(n) for n in (below, below + parts) if n > 0)
    raise BatchSplitError(
        f"a global batch of {global_batch} samples does not split evenly over {replicas} "
        f"replica(s) x {micro_batches} micro-batch(es) ({parts} equal parts); "
        f"use a multiple of {parts}, e.g. {nearest}."
    )


def take_share(batch: Any, index: int, parts: int) -> Any:
    """The ``index``-th of ``parts`` equal contiguous slices along the batch dimension
    (``None``, targets a model that computes its own loss does without, stays ``None``)."""
    if batch is None:
        return None
    size = batch_size(batch) // parts
    return map_tensors(batch, lambda t: t.narrow(0, index * size, size))


def split_micro(batch: Any, micro_batches: int) -> list[Any]:
    """Equal contiguous micro-batches, in order."""
    return [take_share(batch, i, micro_batches) for i in range(micro_batches)]


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in ``batch`` to ``device`` (no copy when already there)."""
    return map_tensors(batch, lambda t: t.to(device, non_blocking=True))
