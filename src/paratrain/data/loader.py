"""Batch loaders for data-parallel training: the same global batches on every rank.

``engine.train_step(inputs, targets)`` takes the *global* batch, identical on every
rank, and each engine slices the share it needs. Two loaders serve that contract:

- :class:`GlobalBatchLoader` yields the whole global batch. Every rank that builds it
  with the same ``seed`` yields the same sequence, with no communication: the order of
  epoch ``e`` is a permutation drawn from a ``torch.Generator`` seeded with
  ``seed + e``.
- :class:`ShardedBatchLoader` yields only rows ``[rank*share, (rank+1)*share)`` of each
  of those global batches -- exactly the rows an engine would slice out -- so a rank
  reads ``1/replicas`` of the data. Concatenating the shares of all ranks in rank order
  gives the global batch back, bit for bit.

Each ``iter(loader)`` starts the next epoch (and so reshuffles); there is no
``set_epoch`` to forget. The one exception is the first ``iter`` after
:meth:`~GlobalBatchLoader.load_state_dict`, which continues the saved epoch at the saved
position, so a run restored from a checkpoint sees the batches it had not seen yet.
:func:`batches` turns a loader into a fixed number of steps across epoch boundaries.

Tail policy -- what happens to the last ``len(dataset) % global_batch`` samples:

- ``tail="drop"`` (default): the incomplete last global batch is dropped; those samples
  land elsewhere in the order of the next epochs.
- ``tail="wrap"``: the last global batch is completed with samples from the start of
  the same epoch's order (as ``DistributedSampler`` pads), so every sample is seen each
  epoch and a few are seen twice.

Either way every batch is full and every rank yields the same number of batches per
epoch. A rank with one batch more or less than the others would wait forever in a
collective the others never enter; equal counts rule that hang out by construction.
A dataset smaller than one global batch is refused with ``tail="drop"`` at construction,
rather than silently yielding nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, TypeVar

import torch
from torch.utils.data import Dataset

__all__ = ["GlobalBatchLoader", "ShardedBatchLoader", "batches", "whole_split"]

Tail = Literal["drop", "wrap"]
T = TypeVar("T")

_STATE_INVARIANTS = ("global_batch", "num_samples", "seed", "shuffle", "tail")


class _EpochBatchLoader:
    """Shared machinery: epoch orders, the tail policy, the cursor and its state."""

    def __init__(
        self, dataset: Dataset, global_batch: int, *, shuffle: bool, seed: int, tail: Tail
    ) -> None:
        if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
            raise ValueError(f"global_batch must be a positive integer, got {global_batch!r}.")
        if tail not in ("drop", "wrap"):
            raise ValueError(f"tail must be 'drop' or 'wrap', got {tail!r}.")
        num_samples = len(dataset)  # type: ignore[arg-type]
        if num_samples == 0:
            raise ValueError("The dataset is empty; a loader needs at least one sample.")
        if tail == "drop" and num_samples < global_batch:
            raise ValueError(
                f"The dataset has {num_samples} samples, fewer than one global batch of "
                f"{global_batch}, so tail='drop' would yield no batch at all; use a "
                f"global_batch of at most {num_samples}, or tail='wrap'."
            )
        self.dataset = dataset
        self.global_batch = global_batch
        self.num_samples = num_samples
        self.shuffle = shuffle
        self.seed = seed
        self.tail: Tail = tail
        self.epoch = 0
        """The epoch being iterated (or, before the first ``iter``, about to be)."""
        self.position = 0
        """How many batches of :attr:`epoch` have been handed out."""
        self._resume = True  # the next iter() continues (epoch, position)
        self._live: object | None = None  # the newest iterator; older ones stop counting
        self._order_cache: tuple[int, torch.Tensor] | None = None

    def __len__(self) -> int:
        """Batches per epoch, the same on every rank."""
        if self.tail == "drop":
            return self.num_samples // self.global_batch
        return math.ceil(self.num_samples / self.global_batch)

    def __iter__(self) -> Iterator[Any]:
        """Start the next epoch, or continue the one a loaded state points into."""
        if not self._resume or self.position >= len(self):
            self.epoch, self.position = self.epoch + 1, 0
        self._resume = False
        token = object()
        self._live = token
        return self._run(self.epoch, self.position, token)

    def global_indices(self, epoch: int, index: int) -> torch.Tensor:
        """Dataset indices of global batch ``index`` of ``epoch`` (the same on every rank)."""
        if not 0 <= index < len(self):
            raise IndexError(f"batch {index} is outside 0..{len(self) - 1} of epoch {epoch}.")
        order = self._epoch_order(epoch)
        return order[index * self.global_batch : (index + 1) * self.global_batch]

    def batch_indices(self, epoch: int, index: int) -> torch.Tensor:
        """Dataset indices this loader reads for batch ``index`` of ``epoch``."""
        return self.global_indices(epoch, index)

    def state_dict(self) -> dict[str, Any]:
        """Where the stream stands: the epoch and how many of its batches were handed out.

        The same on every rank (it does not depend on rank or replica count), so one
        rank's copy in a checkpoint is enough, even to resume on a different number of
        devices with the same global batch. A loader restored from it continues the
        epoch at ``position``, even if this loader's next ``iter`` would start a new one.
        """
        epoch, position = self.epoch, self.position
        if position >= len(self):
            epoch, position = epoch + 1, 0
        state = {name: getattr(self, name) for name in _STATE_INVARIANTS}
        return {"epoch": epoch, "position": position, **state}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``: the next ``iter`` resumes that epoch at that position."""
        for name in _STATE_INVARIANTS:
            if name in state and state[name] != getattr(self, name):
                raise ValueError(
                    f"The loader state was saved with {name}={state[name]!r} but this loader "
                    f"has {name}={getattr(self, name)!r}, which would change the batch order; "
                    "build the loader with the saved settings to resume."
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self):
            raise ValueError(
                f"Loader state epoch={epoch}, position={position} is impossible for "
                f"{len(self)} batches per epoch; pass a state from state_dict()."
            )
        if position == len(self):
            epoch, position = epoch + 1, 0
        self.epoch, self.position = epoch, position
        self._resume = True
        self._live = None

    def _stream(self) -> Iterator[Any]:
        """Like ``iter``, but finishes an epoch left part-way before starting the next."""
        if self.position < len(self):
            self._resume = True
        return iter(self)

    def _run(self, epoch: int, start: int, token: object) -> Iterator[Any]:
        for index in range(start, len(self)):
            batch = self._fetch(self.batch_indices(epoch, index))
            if self._live is token:
                self.position = index + 1
            yield batch

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        """Sample order of one epoch, padded per the tail policy to whole global batches."""
        if self._order_cache is not None and self._order_cache[0] == epoch:
            return self._order_cache[1]
        n = self.num_samples
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(n, generator=generator)
        else:
            order = torch.arange(n)
        pad = len(self) * self.global_batch - n
        if pad > 0:
            order = torch.cat([order, order.repeat(math.ceil(pad / n))[:pad]])
        self._order_cache = (epoch, order)
        return order

    def _fetch(self, indices: torch.Tensor) -> Any:
        tensors = getattr(self.dataset, "tensors", None)
        if tensors is not None:
            return tuple(tensor[indices] for tensor in tensors)
        return _collate([self.dataset[i] for i in indices.tolist()])


class GlobalBatchLoader(_EpochBatchLoader):
    """Yields whole global batches, identical on every rank built with the same ``seed``.

    A batch is a tuple of tensors (one per dataset field, e.g. ``(inputs, targets)``).
    A ``TensorDataset`` (anything with ``.tensors``) is indexed with one index tensor,
    no per-sample Python; any other dataset is read item by item and stacked.
    """

    def __init__(
        self,
        dataset: Dataset,
        global_batch: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        tail: Tail = "drop",
    ) -> None:
        super().__init__(dataset, global_batch, shuffle=shuffle, seed=seed, tail=tail)


class ShardedBatchLoader(_EpochBatchLoader):
    """Yields this rank's contiguous share of each global batch, and reads only that.

    Share ``rank`` of global batch ``i`` is rows ``[rank*share, (rank+1)*share)`` with
    ``share = global_batch // replicas``: the rows an engine takes from the global
    batch, so sharded loading changes what is read, never what is computed.
    """

    def __init__(
        self,
        dataset: Dataset,
        global_batch: int,
        *,
        rank: int,
        replicas: int,
        shuffle: bool = True,
        seed: int = 0,
        tail: Tail = "drop",
    ) -> None:
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"replicas must be a positive integer, got {replicas!r}.")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < replicas:
            raise ValueError(
                f"rank {rank!r} is outside 0..{replicas - 1} for {replicas} replicas; pass "
                "this process's rank in the data-parallel group."
            )
        if isinstance(global_batch, int) and global_batch >= 1 and global_batch % replicas:
            lower = global_batch // replicas * replicas
            upper = lower + replicas
            options = f"{lower} or {upper}" if lower else f"{upper}"
            raise ValueError(
                f"global_batch {global_batch} does not split evenly over {replicas} "
                f"replicas; use a multiple of {replicas}, e.g. {options}."
            )
        super().__init__(dataset, global_batch, shuffle=shuffle, seed=seed, tail=tail)
        self.rank = rank
        self.replicas = replicas
        self.share = global_batch // replicas

    def batch_indices(self, epoch: int, index: int) -> torch.Tensor:
        """Dataset indices of this rank's share of global batch ``index`` of ``epoch``."""
        rows = self.global_indices(epoch, index)
        return rows[self.rank * self.share : (self.rank + 1) * self.share]


def batches(loader: Iterable[T], steps: int) -> Iterator[T]:
    """Yield exactly ``steps`` batches from ``loader``, starting new epochs as needed.

    For step-based training loops. With a paratrain loader the stream continues where
    the loader stands (an epoch left part-way by an earlier call is finished first), so
    ``batches(loader, 100)`` twice yields the same batches as ``batches(loader, 200)``
    once. Any other re-iterable (a ``DataLoader``, a list) is simply iterated again.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be a non-negative integer, got {steps!r}.")
    return _take(loader, steps)


def whole_split(dataset: Dataset, global_batch: int) -> Iterator[tuple[Any, int]]:
    """Every sample of ``dataset`` once, in order, as whole global batches, each with how
    many of its leading rows are real.

    For an evaluation over a whole test split: the engines split a batch evenly over
    replicas and micro-batches, so the last, short batch is completed (``tail="wrap"``)
    with repeats of the split's first rows; the caller masks rows from ``real`` on, so
    that every sample counts exactly once however the split divides the batch.
    """
    loader = GlobalBatchLoader(dataset, global_batch, shuffle=False, tail="wrap")
    remaining = loader.num_samples
    for batch in loader:
        yield batch, min(remaining, global_batch)
        remaining -= global_batch


def _take(loader: Iterable[T], steps: int) -> Iterator[T]:
    remaining = steps
    while remaining > 0:
        stream = loader._stream() if isinstance(loader, _EpochBatchLoader) else iter(loader)
        produced = 0
        for batch in stream:
            yield batch
            produced += 1
            remaining -= 1
            if remaining == 0:
                return
        if produced == 0:
            raise ValueError(
                f"The loader yielded no batch in a whole pass, so {steps} steps can never "
                "be reached; check that the dataset is not empty."
            )


def _collate(items: Sequence[Any]) -> Any:
    """Stack per-sample items into a batch, keeping their structure (tuple, dict, tensor)."""
    first = items[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(list(items))
    if isinstance(first, (tuple, list)):
        return tuple(_collate(list(field)) for field in zip(*items, strict=True))
    if isinstance(first, Mapping):
        return {key: _collate([item[key] for item in items]) for key in first}
    if isinstance(first, (int, float, bool)):
        return torch.tensor(items)
    raise TypeError(
        f"Cannot batch dataset items of type {type(first).__name__}; return tensors, "
        "numbers, or tuples/dicts of them from the dataset's __getitem__."
    )
