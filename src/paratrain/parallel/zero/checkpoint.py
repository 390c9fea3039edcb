"""ZeRO checkpoints in the common format: canonical tensors out, this rank's slices in.

The checkpoint format stores whole tensors under the single-device model's names
(``"3.weight"``, ``"3.weight/exp_avg"``), which is what lets any engine load any
checkpoint. A flat slice cuts across parameters, so:

- Saving gathers, one unit and one state key at a time, every rank's slice (an all-gather,
  so every worker calls it) and cuts the full flat buffer back into parameters; rank 0
  writes the result. Rank 0 therefore holds the whole model and optimizer state in CPU
  memory while it writes (the memory ZeRO saves during training is spent once here).
- Loading reads each parameter's tensors by name, lays them out as the unit's flat buffer
  and keeps this rank's slice: any checkpoint (dp, pipeline, another ZeRO stage or device
  count) loads.

Optimizer state: a value shaped like the slice (Adam's ``exp_avg``, SGD's
``momentum_buffer``) is elementwise and is split per parameter; anything else (Adam's
``step``) is per-parameter bookkeeping and is written for each parameter of the unit, as
``torch.optim`` keeps it per parameter. When loading, a saved tensor shaped like its
parameter is elementwise (except ``step`` of a 0-d parameter, where the two look alike);
a parameter with no saved state (never updated in a single-device run) gets zeros.

A unit the optimizer holds as per-parameter pieces (``unused``: some parameter of it went
unused in a step) has per-parameter bookkeeping that may differ between its parameters and
lives on whichever ranks hold a piece: saving gathers each rank's state keys and
per-parameter values (a small object all-gather), then every elementwise key as above,
and writes each parameter's own state, none for a parameter never updated, as torch
keeps it. Loading holds a unit as pieces (splitting it first) when the saved state of
its parameters differs in keys or in per-parameter values, so that a parameter that
skipped steps (fewer Adam steps, no SGD buffer yet) resumes exactly; otherwise as one
slice, as before.

Parameter groups (``groups``): the optimizer's groups are the user's, in order, so each
saved group lists the names of all its parameters and its own hyperparameters; no slice
mixes groups, and a unit whose parameters span several groups is held as pieces from the
start, so its state is saved and loaded per parameter as above.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from paratrain.checkpoints.format import Checkpoint
from paratrain.parallel.checkpointing import ShardedCheckpointState
from paratrain.parallel.optim_state import load_named_optimizer_state, named_optimizer_state
from paratrain.parallel.zero.groups import ParamGroups
from paratrain.parallel.zero.shards import FlatUnit
from paratrain.parallel.zero.unused import ShardPieces
from paratrain.runtime import comm

_UNIT = "<unit>"
_ELEMENTWISE = "<elementwise>"
"""Stands, in the state keys ranks exchange, for a value cut per element (a string: it
does not survive pickling as the same object, so it is recognised by type)."""


class ZeroCheckpointState(ShardedCheckpointState):
    """The ``ShardedCheckpointState`` hooks of a ZeRO engine: it holds ``units`` (flat
    units with this rank's ``shard``), ``pieces`` (the units the optimizer holds as
    per-parameter pieces), ``group``, ``optimizer``, ``param_groups`` (which parameter
    names each optimizer group holds) and ``_load_units``."""

    units: list[FlatUnit]
    pieces: ShardPieces
    group: Any
    optimizer: torch.optim.Optimizer | None
    param_groups: ParamGroups

    def gather_checkpoint_state(
        self,
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[dict[str, Any]]]:
        """Canonical model tensors, optimizer tensors and groups on the writer; empty elsewhere
        (split layers as this worker's slices: the checkpoint code joins them)."""
        model = self.local_state()
        writer = self.writes_shard()
        if self.optimizer is None:
            return (model, {}, []) if writer else ({}, {}, [])
        tensors: dict[str, torch.Tensor] = {}
        for index, unit in enumerate(self.units):
            if index in self.pieces.pieces:
                tensors.update(self._gather_pieces(unit, self.pieces.pieces[index], writer))
                continue
            state = self.optimizer.state.get(unit.shard, {})
            for key in sorted(state):
                value = state[key]
                value = value if isinstance(value, torch.Tensor) else torch.tensor(value)
                if value.shape == unit.shard.shape:
                    full = value.new_empty(unit.padded_numel)
                    comm.all_gather_flat(full, value.detach().contiguous(), group=self.group)
                    pieces = unit.param_views(full)
                else:
                    pieces = [value.detach()] * len(unit.names)
                if writer:
                    for name, piece in zip(unit.names, pieces, strict=True):
                        tensors[f"{name}/{key}"] = piece.to("cpu", copy=True)
        if not writer:
            return {}, {}, []
        keys = {id(unit.shard): f"{_UNIT}{index}" for index, unit in enumerate(self.units)}
        for index, pieces in self.pieces.pieces.items():
            keys.update({id(piece): f"{_UNIT}{index}" for *_, piece in pieces})
        _, unit_groups = named_optimizer_state(self.optimizer, keys)
        # The user's groups by the names of all their parameters, whichever pieces rank 0
        # holds (the optimizer's groups are the user's, in order; see ``groups``).
        groups = [
            {**group, "params": list(names)}
            for group, names in zip(unit_groups, self.param_groups.names, strict=True)
        ]
        return model, tensors, groups

    def _gather_pieces(
        self, unit: FlatUnit, pieces: list[tuple[int, int, int, torch.Tensor]], writer: bool
    ) -> dict[str, torch.Tensor]:
        """Each parameter's own optimizer state from the ranks holding its pieces."""
        mine: dict[str, dict[str, Any]] = {}
        for index, _start, _end, piece in pieces:
            state = self.optimizer.state.get(piece, {})
            mine[unit.names[index]] = {
                key: _ELEMENTWISE if _elementwise_of(value, piece) else _as_tensor(value)
                for key, value in state.items()
            }
        merged: dict[str, dict[str, Any]] = {}
        for theirs in comm.all_gather_objects(mine, group=self.group):
            for name, keys in theirs.items():
                merged.setdefault(name, {}).update(keys)
        tensors: dict[str, torch.Tensor] = {}
        elementwise = sorted(
            {key for keys in merged.values() for key, v in keys.items() if isinstance(v, str)}
        )
        for key in elementwise:
            local = unit.shard.detach().new_zeros(unit.shard_numel)
            for _index, start, end, piece in pieces:
                value = self.optimizer.state.get(piece, {}).get(key)
                if value is not None:
                    local[start:end].copy_(value)
            full = local.new_empty(unit.padded_numel)
            comm.all_gather_flat(full, local, group=self.group)
            if writer:
                for name, view in zip(unit.names, unit.param_views(full), strict=True):
                    if isinstance(merged.get(name, {}).get(key), str):
                        tensors[f"{name}/{key}"] = view.to("cpu", copy=True)
        if writer:
            for name, keys in merged.items():
                for key, value in keys.items():
                    if not isinstance(value, str):
                        tensors[f"{name}/{key}"] = value
        return tensors

    def load_checkpoint_state(self, checkpoint: Checkpoint) -> None:
        """Set this rank's model and optimizer slices from any engine's checkpoint."""
        self._load_units(lambda name: checkpoint.tensor("model", name))
        optimizer_meta = checkpoint.manifest.get("optimizer")
        if self.optimizer is None or not optimizer_meta:
            return
        saved_keys: dict[str, set[str]] = defaultdict(set)
        for qualified in checkpoint.names("optim"):
            name, _, key = qualified.rpartition("/")
            saved_keys[name].add(key)
        for index, unit in enumerate(self.units):
            if index not in self.pieces.pieces and not _same_history(unit, saved_keys, checkpoint):
                self.pieces.split(index, keep_state=False)
        names: dict[int, str] = {}
        state_keys: dict[str, list[str]] = {}
        values: dict[str, Any] = {}  # the name the optimizer knows -> how to read its state
        for index, unit in enumerate(self.units):
            if index in self.pieces.pieces:
                for param_index, start, end, piece in self.pieces.pieces[index]:
                    name = unit.names[param_index]
                    names[id(piece)] = name
                    state_keys[name] = sorted(saved_keys.get(name, ()))
                    values[name] = (unit, param_index, start, end)
            else:
                first = unit.names[0]
                names[id(unit.shard)] = first
                state_keys[first] = sorted(
                    set().union(*(saved_keys.get(name, set()) for name in unit.names))
                )
                values[first] = unit

        def fetch(qualified: str) -> torch.Tensor:
            name, _, key = qualified.rpartition("/")
            where = values[name]
            if isinstance(where, FlatUnit):
                saved = {
                    name: checkpoint.tensor("optim", f"{name}/{key}")
                    for name in where.names
                    if key in saved_keys.get(name, ())
                }
                return _unit_value(where, key, saved)
            return _piece_value(*where, key, checkpoint.tensor("optim", qualified))

        load_named_optimizer_state(
            self.optimizer, names, optimizer_meta["param_groups"], state_keys, fetch
        )


def _as_tensor(value: Any) -> torch.Tensor:
    tensor = value if isinstance(value, torch.Tensor) else torch.tensor(value)
    return tensor.detach().to("cpu", copy=True)


def _elementwise_of(value: Any, piece: torch.Tensor) -> bool:
    """Whether a piece's state value is elementwise (a piece is 1-d; bookkeeping is 0-d)."""
    return isinstance(value, torch.Tensor) and value.shape == piece.shape


def _saved_elementwise(value: torch.Tensor, param: torch.Tensor, key: str) -> bool:
    """Whether a saved state tensor is elementwise, by the rule in the module docstring."""
    return value.shape == param.shape and not (param.dim() == 0 and key == "step")


def _same_history(unit: FlatUnit, saved_keys: dict[str, set[str]], checkpoint) -> bool:
    """Whether the saved state of every parameter of ``unit`` has the same keys and the
    same per-parameter values, so that one slice of the optimizer can hold it."""
    keys = {frozenset(saved_keys.get(name, ())) for name in unit.names}
    if len(keys) > 1:
        return False
    for key in next(iter(keys)):
        shared = None
        for name, param in zip(unit.names, unit.params, strict=True):
            value = checkpoint.tensor("optim", f"{name}/{key}")
            if _saved_elementwise(value, param, key):
                continue
            if shared is None:
                shared = value
            elif not torch.equal(value, shared):
                return False
    return True


def _unit_value(unit: FlatUnit, key: str, saved: dict[str, torch.Tensor]) -> torch.Tensor:
    """This rank's slice of an elementwise state, or the shared value of a scalar one."""
    name, value = next(iter(saved.items()))
    param = unit.params[unit.names.index(name)]
    if not _saved_elementwise(value, param, key):
        return value
    flat = unit.flatten([saved.get(n) for n in unit.names])
    return unit.my_slice(flat).clone()


def _piece_value(
    unit: FlatUnit, index: int, start: int, end: int, key: str, value: torch.Tensor
) -> torch.Tensor:
    """A piece's part of its parameter's saved state (the whole value if per-parameter)."""
    if not _saved_elementwise(value, unit.params[index], key):
        return value
    first = unit.rank * unit.shard_numel + start - unit.offsets[index]
    return value.reshape(-1)[first : first + end - start].clone()
