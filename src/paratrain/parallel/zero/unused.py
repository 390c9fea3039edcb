"""Parameters no replica used in a step: the sharded optimizer skips them as torch does.

The plain loop leaves ``.grad`` None for a parameter that no backward of the step reached,
and ``torch.optim`` then skips it: no momentum decay, no Adam step (its step count, and so
its bias correction, stays behind the others'), no weight decay. A ZeRO rank's optimizer
holds one flat slice per unit, which mixes parameters: it cannot skip part of a tensor,
and it keeps one set of per-tensor bookkeeping (Adam's ``step``, SGD's "first step: the
buffer is the gradient") for parameters whose histories now differ.

So the first time a unit holds a parameter that no replica used (``grads.unused``), the
unit's slice is split, on every rank, into one piece per parameter it cuts: each piece is
a view into the slice (the slice stays the unit's storage; messages and gathers are
unchanged) and takes its part of the slice's state, elementwise values sliced and
per-tensor ones copied (until then every parameter of the unit had the same history, so
they are all the same). From then on the optimizer holds that unit's pieces instead of its
slice, and every step gives a piece its part of the reduced gradient, or None where no
replica used its parameter, as torch gives the whole parameter. The optimizers ZeRO
accepts are elementwise (``optim``), so a piece is updated as those elements of the
whole parameter would be, with the parameter's own bookkeeping: exact for each of them,
whatever its hyperparameters, with no list of special cases to keep.

A unit whose parameters belong to different parameter groups (``groups``; zero3's units
are modules, whose weights and biases the usual recipe groups apart) is held as pieces
from the start, each piece in its parameter's group: the same mechanism, so such a unit's
checkpoint state is per parameter too.

Cost: a unit whose parameters are always used keeps one flat tensor in the optimizer
(the all-used path is unchanged); a split unit steps per piece, the per-tensor loop
torch's default runs on CPU anyway.
"""

from __future__ import annotations

import torch
from torch import nn

from paratrain.parallel.zero.shards import FlatUnit


def piece_ranges(unit: FlatUnit) -> list[tuple[int, int, int]]:
    """``(parameter index, start, end)`` of each parameter's part of this rank's slice,
    in slice coordinates; parameters the slice does not reach are left out."""
    first = unit.rank * unit.shard_numel
    last = first + unit.shard_numel
    ranges = []
    for index, (param, offset) in enumerate(zip(unit.params, unit.offsets, strict=True)):
        start, end = max(offset, first), min(offset + param.numel(), last)
        if start < end:
            ranges.append((index, start - first, end - first))
    return ranges


Pieces = list[tuple[int, int, int, nn.Parameter]]
"""``(parameter index, start, end, piece)`` of a unit held as per-parameter pieces."""


def make_pieces(unit: FlatUnit) -> Pieces:
    """One ``nn.Parameter`` per parameter this rank's slice reaches, a view into the slice."""
    shard = unit.shard.detach()
    return [
        (param_index, start, end, nn.Parameter(shard.narrow(0, start, end - start)))
        for param_index, start, end in piece_ranges(unit)
    ]


class ShardPieces:
    """Which units the optimizer holds as per-parameter pieces, and their gradients."""

    def __init__(
        self,
        units: list[FlatUnit],
        optimizer: torch.optim.Optimizer,
        pieces: dict[int, Pieces] | None = None,
    ) -> None:
        """``pieces``: units the optimizer was built over as pieces (parameter groups)."""
        self.units = units
        self.optimizer = optimizer
        self.pieces: dict[int, Pieces] = dict(pieces or {})
        """Unit index -> ``(parameter index, start, end, piece)`` for each split unit."""

    def split(self, index: int, *, keep_state: bool = True) -> None:
        """Hold unit ``index`` as pieces from now on; each piece takes its part of the
        slice's optimizer state (or none, when a checkpoint is about to set it)."""
        if index in self.pieces:
            return
        shard = self.units[index].shard
        pieces = make_pieces(self.units[index])
        state = self.optimizer.state.pop(shard, {})
        for _, start, end, piece in pieces:
            if keep_state and state:
                self.optimizer.state[piece] = {
                    key: _part(value, shard, start, end) for key, value in state.items()
                }
        for group in self.optimizer.param_groups:
            params = group["params"]
            for position, param in enumerate(params):
                if param is shard:
                    params[position : position + 1] = [piece for *_, piece in pieces]
                    break
        self.pieces[index] = pieces

    def assign_grads(self, unused: list[list[int]] | None) -> None:
        """Split the units that hold a parameter no replica used (``unused``, per unit),
        then give every piece its part of the reduced slice gradient, or None."""
        if unused is not None:
            for index, skipped in enumerate(unused):
                if skipped:
                    self.split(index)
        for index, pieces in self.pieces.items():
            grad = self.units[index].shard.grad
            skipped = set(unused[index]) if unused is not None else ()
            for param_index, start, end, piece in pieces:
                if param_index in skipped or grad is None:
                    piece.grad = None
                else:
                    piece.grad = grad.narrow(0, start, end - start)


def _part(value, shard: torch.Tensor, start: int, end: int):
    """A piece's share of one optimizer state value of the whole slice."""
    if isinstance(value, torch.Tensor):
        if value.shape == shard.shape:
            return value.narrow(0, start, end - start).clone()
        return value.clone()
    return value
