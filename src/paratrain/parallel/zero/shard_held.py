"""The zero2 engine's side of shard copies: exchange after each step, offer, take back.

Why a mixin: the exchange belongs after the parameter all-gather that ends each step, and
the recovery needs the engine's units, optimizer and checkpoint loader; the ring and the
version bookkeeping live in ``shard_copies``, the reassembly in ``shard_recovery``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from paratrain.parallel.zero.shard_copies import ShardCopies
from paratrain.parallel.zero.shard_recovery import (
    InMemoryCheckpoint,
    canonical_from_slices,
    missing_slices,
    pick_slices,
)
from paratrain.runtime.elastic import ElasticStateLost


class ShardCopiesMixin:
    """For ``Zero2Engine``: ``shard_copies`` is a ``ShardCopies`` or None (off)."""

    shard_copies: ShardCopies | None = None

    def _copies(self, model: nn.Module) -> ShardCopies:
        """The ring over the replicas; refused where a death could not be survived exactly."""
        if self.tensor_split is not None:
            raise ValueError(
                "shard_copies keeps whole replicas' slices and does not yet cover split "
                "layers; drop tensor or shard_copies."
            )
        if any(getattr(m, "track_running_stats", False) for m in model.modules()):
            raise ValueError(
                "shard_copies does not carry BatchNorm running statistics a step in flight "
                "may have changed across a death; drop shard_copies or the BatchNorm layers."
            )
        return ShardCopies(
            self.units, self.optimizer, self.group, self._replica_rank, self._replicas
        )

    def _after_step(self) -> None:
        """The slices gathered (the base), then the ring exchange of the new slices."""
        copies = self.shard_copies
        if copies is not None:
            copies.version = self.steps_taken + 1  # the live slice has just stepped
        super()._after_step()
        if copies is not None:
            copies.exchange(self.steps_taken + 1, pieces=bool(self.pieces.pieces))

    def model_state_bytes(self) -> dict[str, int]:
        counts = super().model_state_bytes()
        if self.shard_copies is not None:
            counts["optimizer"] = counts.get("optimizer", 0) + self.shard_copies.bytes()
        return counts

    def held_shards(self) -> dict[str, Any]:
        """What this worker offers the survivors' recovery: its steps, every slice it holds
        with their versions, and the tensors outside the units (buffers, frozen weights)."""
        copies = self.shard_copies
        version = max(copies.version, self.steps_taken)
        in_units = {name for unit in self.units for name in unit.names}
        other = {k: v for k, v in self.local_state().items() if k not in in_units}
        return {
            "steps": self.steps_taken,
            "world": copies.world,
            "units": [list(unit.names) for unit in self.units],
            "held": copies.held(version) if copies.usable else {},
            "other": other,
        }

    def load_held_shards(self, offers: list[dict[str, Any]], survivors: tuple[int, ...]) -> int:
        """Every survivor's ``held_shards`` (in the new group's order): the state at the
        furthest survivor's step count put together and loaded, the copies exchanged over
        the new group; returns that step count. ``ElasticStateLost`` if a slice is missing."""
        steps = max(offer["steps"] for offer in offers)
        world = offers[0]["world"]
        versions = [
            {rank: [h.version for h in held] for rank, held in offer["held"].items()}
            for offer in offers
        ]
        missing = missing_slices(world, versions, steps)
        if missing:
            raise ElasticStateLost(
                f"no survivor holds the optimizer slice of replica(s) "
                f"{', '.join(map(str, missing))} (of {world}) at step {steps}",
                survivors,
            )
        if offers[0]["units"] != [list(unit.names) for unit in self.units]:
            raise RuntimeError("the new group's units differ from the old: bucket_mb changed?")
        slices = pick_slices([offer["held"] for offer in offers], steps)
        shapes = [(unit.names, [p.shape for p in unit.params]) for unit in self.units]
        model, optim = canonical_from_slices(slices, shapes)
        model.update(offers[0]["other"])
        groups = [
            {**{k: v for k, v in group.items() if k != "params"}, "params": list(names)}
            for group, names in zip(
                self.optimizer.param_groups, self.param_groups.names, strict=True
            )
        ]
        self.load_checkpoint_state(InMemoryCheckpoint(model, optim, groups))
        self.steps_taken = steps
        self.shard_copies.exchange(steps, pieces=bool(self.pieces.pieces))
        return steps
