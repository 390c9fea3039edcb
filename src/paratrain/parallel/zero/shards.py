"""Flat sharding: a unit's parameters laid end to end in one padded buffer, 1/N per rank.

Why flat (as DeepSpeed and FSDP do) rather than whole parameters per rank: every rank then
owns exactly ``ceil(numel / N)`` elements of every unit, whatever the parameter shapes,
so the per-worker memory follows the ZeRO formulas (1/N of the state) up to at most N-1
padding elements per unit, and each unit needs exactly one reduce-scatter and one
all-gather of equal-sized pieces, which is what the collectives want.

A unit owns:

- ``full``: the padded flat buffer, ``N * shard_numel`` elements. Each model parameter's
  ``.data`` is a view into it, so filling ``full`` (an all-gather) updates the model in
  place and autograd keeps working on the same parameter objects.
- ``shard``: the ``nn.Parameter`` this rank optimizes, its slice ``[rank * S, (rank+1) * S)``
  of ``full``. Stages 1-2 keep ``full`` alive and ``shard`` is a view into it (the
  optimizer writes straight into the model); stage 3 gives ``shard`` its own storage and
  frees ``full`` between uses by resizing its storage to zero bytes (FSDP's trick: the
  parameter views and the tensors autograd saved keep pointing at the same storage, which
  is refilled by the next all-gather).

Padding elements start at zero and always receive a zero gradient, so elementwise
optimizers (SGD, Adam, AdamW...) leave them at zero.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from paratrain.runtime import comm


class ZeroLayoutError(ValueError):
    """The model cannot be laid out in flat shards as asked."""


class FlatUnit:
    """The parameters ``named_params`` of one unit, flat-sharded over ``world`` ranks."""

    def __init__(
        self,
        label: str,
        named_params: list[tuple[str, nn.Parameter]],
        *,
        rank: int,
        world: int,
        own_shard_storage: bool,
    ) -> None:
        dtypes = {p.dtype for _, p in named_params}
        devices = {p.device for _, p in named_params}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ZeroLayoutError(
                f"unit {label!r} mixes parameter dtypes/devices {sorted(map(str, dtypes))}; "
                "ZeRO flattens a unit into one buffer, so give its parameters one dtype."
            )
        self.label = label
        self.names = [name for name, _ in named_params]
        self.params = [param for _, param in named_params]
        self.rank, self.world = rank, world
        self.offsets: list[int] = []
        total = 0
        for param in self.params:
            self.offsets.append(total)
            total += param.numel()
        self.numel = total
        self.shard_numel = max(1, math.ceil(total / world))
        self.padded_numel = self.shard_numel * world
        self.full = torch.zeros(self.padded_numel, dtype=dtypes.pop(), device=devices.pop())
        with torch.no_grad():
            for param, view in zip(self.params, self.param_views(self.full), strict=True):
                view.copy_(param)
                param.data = view
        mine = self.full.narrow(0, rank * self.shard_numel, self.shard_numel)
        self.shard = nn.Parameter(mine.clone() if own_shard_storage else mine)
        self.gathered = True
        self.on_gathered: Callable[[torch.Tensor], None] | None = None
        """Called with ``full`` after each stage-3 gather (the memory ledger excludes it)."""
        self.on_releasing: Callable[[torch.Tensor], None] | None = None
        """Called with ``full`` just before its memory is freed."""

    # -- layout -----------------------------------------------------------------------------

    def param_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's piece of a flat buffer laid out like ``full``, in its shape."""
        return [
            flat.narrow(0, offset, param.numel()).view_as(param)
            for param, offset in zip(self.params, self.offsets, strict=True)
        ]

    def flatten(self, pieces: list[torch.Tensor | None]) -> torch.Tensor:
        """A new padded flat buffer holding ``pieces`` (one per parameter; None -> zeros)."""
        flat = self.full.new_zeros(self.padded_numel)
        for view, piece in zip(self.param_views(flat), pieces, strict=True):
            if piece is not None:
                view.copy_(piece)
        return flat

    def shard_pieces(self, shard: torch.Tensor | None) -> list[tuple[str, torch.Tensor]]:
        """(parameter name, the part of it) for each parameter ``shard`` (a tensor laid out
        like this rank's slice, such as its gradient) covers; views, so that scaling them
        scales ``shard``. The padding belongs to no parameter and is left out."""
        if shard is None:
            return []
        start, end = self.rank * self.shard_numel, (self.rank + 1) * self.shard_numel
        pieces = []
        for name, param, offset in zip(self.names, self.params, self.offsets, strict=True):
            low, high = max(start, offset), min(end, offset + param.numel())
            if low < high:
                pieces.append((name, shard.narrow(0, low - start, high - low)))
        return pieces

    def my_slice(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a padded flat buffer."""
        return flat.narrow(0, self.rank * self.shard_numel, self.shard_numel)

    # -- stage 3: materialise and free ------------------------------------------------------

    def gather(self, group=None) -> None:
        """Refill ``full`` from every rank's shard (blocking; bounded by the group timeout)."""
        if self.gathered:
            return
        self.full.untyped_storage().resize_(self.padded_numel * self.full.element_size())
        comm.all_gather_flat(self.full, self.shard.detach(), group=group)
        self.gathered = True
        if self.on_gathered is not None:
            self.on_gathered(self.full)

    def release(self) -> None:
        """Free ``full``'s memory; the parameter views stay valid but empty until ``gather``."""
        if not self.gathered:
            return
        if self.on_releasing is not None:
            self.on_releasing(self.full)
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def load_full(self, fetch: Callable[[str], torch.Tensor]) -> None:
        """Set this rank's shard (and ``full`` if materialised) from canonical tensors."""
        with torch.no_grad():
            flat = self.flatten([fetch(name).to(self.full.dtype) for name in self.names])
            self.shard.copy_(self.my_slice(flat))
            if self.gathered:
                self.full.copy_(flat)


def trainable(named_params: list[tuple[str, nn.Parameter]]) -> list[tuple[str, nn.Parameter]]:
    """The parameters that get gradients (frozen ones stay replicated, like buffers)."""
    return [(name, param) for name, param in named_params if param.requires_grad]
