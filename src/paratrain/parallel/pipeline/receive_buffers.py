"""Receive buffers a link reuses once nothing holds them any more.

Why: a stage received each activation and gradient into a new buffer, and a new buffer
of a quarter of a megabyte or more is fresh pages from the kernel (an ``mmap``, then a
fault per page at the first write), paid between two passes: in the 2-stage mlp's
workers, allocating one took a median 0.02 ms. With the buffers reused, the last stage's
fed forwards of mlp ZB-H1 on gloo start a median 194 us after they could, against 238
(``benchmarks/pipeline_gaps.py``). So a link keeps the buffers it received into and hands
one out again once nothing else holds it.

"Nothing holds it" is read off the buffer's storage: every tensor that shares it (the
alias handed out, a view of it, a copy autograd saved for the backward) holds a count on
it, so a buffer whose storage counts only the pool's own reference is free, whatever the
model did with its input. Where this torch lacks the count, buffers are not reused.
Buffers of shapes the last round did not receive are dropped, so a batch shape that
changes every step keeps no more than one round's buffers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_use_count = getattr(torch._C, "_storage_Use_Count", None)


class _Kept:
    """One buffer, its bytes (a flat view, for transports that move bytes), and its
    storage's count when only the pool holds it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.bytes = tensor.reshape(-1).view(torch.uint8)
        self._storage = tensor.untyped_storage()._cdata  # valid while ``tensor`` lives
        self.alone = _use_count(self._storage)

    def free(self) -> bool:
        return _use_count(self._storage) == self.alone


class ReceiveBuffers:
    """The buffers one link receives into, reused round after round."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reusing = _use_count is not None
        self._kept: dict[tuple, list[_Kept]] = {}
        self._used: set[tuple] = set()

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """A buffer of ``shape`` and ``dtype`` that nothing else holds, and its bytes: an
        alias of a kept one where one is free, else a new one (kept for later)."""
        if not self.reusing:
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
            return tensor, tensor.reshape(-1).view(torch.uint8)
        key = (dtype, tuple(shape))
        self._used.add(key)
        kept = self._kept.setdefault(key, [])
        for buffer in kept:
            if buffer.free():
                return buffer.tensor.detach(), buffer.bytes
        buffer = _Kept(torch.empty(shape, dtype=dtype, device=self.device))
        kept.append(buffer)
        return buffer.tensor.detach(), buffer.bytes

    def new_round(self) -> None:
        """Drop the buffers of shapes the round just ended did not receive."""
        for key in [key for key in self._kept if key not in self._used]:
            del self._kept[key]
        self._used = set()

    def idle_bytes(self) -> int:
        """Bytes of kept buffers nothing holds now (for the memory ledger: those in use
        are counted where they are held)."""
        return sum(
            b.tensor.numel() * b.tensor.element_size()
            for kept in self._kept.values()
            for b in kept
            if b.free()
        )
