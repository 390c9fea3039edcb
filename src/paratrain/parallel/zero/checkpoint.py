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
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from paratrain.checkpoint import Checkpoint
from paratrain.parallel.checkpointing import ShardedCheckpointState
from paratrain.parallel.optim_state import load_named_optimizer_state, named_optimizer_state
from paratrain.parallel.zero.shards import FlatUnit
from paratrain.runtime import comm

_UNIT = "<unit>"


class ZeroCheckpointState(ShardedCheckpointState):
    """The ``ShardedCheckpointState`` hooks of a ZeRO engine: it holds ``units`` (flat
    units with this rank's ``shard``), ``group``, ``optimizer`` and ``_load_units``."""

    units: list[FlatUnit]
    group: Any
    optimizer: torch.optim.Optimizer | None

    def gather_checkpoint_state(
        self,
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[dict[str, Any]]]:
        """Canonical model tensors, optimizer tensors and groups on the writer; empty elsewhere."""
        model = self.state_dict()
        writer = self.writes_shard()
        if self.optimizer is None:
            return (model, {}, []) if writer else ({}, {}, [])
        tensors: dict[str, torch.Tensor] = {}
        for unit in self.units:
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
        _, unit_groups = named_optimizer_state(self.optimizer, keys)
        groups = [
            {
                **group,
                "params": [
                    name
                    for key in group["params"]
                    for name in self.units[int(key[len(_UNIT) :])].names
                ],
            }
            for group in unit_groups
        ]
        return model, tensors, groups

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
        unit_by_first = {unit.names[0]: unit for unit in self.units}
        state_keys = {
            first: sorted(set().union(*(saved_keys.get(name, set()) for name in unit.names)))
            for first, unit in unit_by_first.items()
        }

        def fetch(qualified: str) -> torch.Tensor:
            first, _, key = qualified.rpartition("/")
            unit = unit_by_first[first]
            saved = {
                name: checkpoint.tensor("optim", f"{name}/{key}")
                for name in unit.names
                if key in saved_keys.get(name, ())
            }
            return _unit_value(unit, key, saved)

        load_named_optimizer_state(
            self.optimizer,
            {id(unit.shard): unit.names[0] for unit in self.units},
            optimizer_meta["param_groups"],
            state_keys,
            fetch,
        )


def _unit_value(unit: FlatUnit, key: str, saved: dict[str, torch.Tensor]) -> torch.Tensor:
    """This rank's slice of an elementwise state, or the shared value of a scalar one."""
    name, value = next(iter(saved.items()))
    param = unit.params[unit.names.index(name)]
    elementwise = value.shape == param.shape and not (param.dim() == 0 and key == "step")
    if not elementwise:
        return value
    flat = unit.flatten([saved.get(n) for n in unit.names])
    return unit.my_slice(flat).clone()
