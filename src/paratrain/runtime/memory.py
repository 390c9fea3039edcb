"""Counting the bytes autograd saves for backward (activations), current and peak.

Why saved-tensor hooks: on CPU there is no allocator to ask, and what costs memory between
forward and backward is exactly what autograd packs for backward. Storages are counted
once however many saved views point into them, and the model's own parameters (saved by
matmuls) are not activations and are left out.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch.autograd.graph import saved_tensors_hooks


class ActivationMeter:
    """Bytes of activations held for backward, grouped by a key (e.g. a micro-batch)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._seen: dict[Hashable, set[int]] = {}
        self._bytes: dict[Hashable, int] = {}
        self.current = 0
        self.peak = 0

    @contextmanager
    def record(self, key: Hashable) -> Iterator[None]:
        """Count what autograd saves inside this block under ``key``."""
        seen = self._seen.setdefault(key, set())
        self._bytes.setdefault(key, 0)

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            pointer = storage.data_ptr()
            if pointer not in self._excluded and pointer not in seen and storage.nbytes():
                seen.add(pointer)
                self._bytes[key] += storage.nbytes()
                self.current += storage.nbytes()
                self.peak = max(self.peak, self.current)
            return tensor

        with saved_tensors_hooks(pack, lambda tensor: tensor):
            yield

    def release(self, key: Hashable) -> None:
        """Backward for ``key`` is done: its saved activations are freed."""
        self.current -= self._bytes.pop(key, 0)
        self._seen.pop(key, None)

    def reset_peak(self) -> None:
        self.peak = self.current
