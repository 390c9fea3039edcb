"""zero2's slices put back together from the survivors' own slices and shard copies.

Why in canonical names: the survivors are fewer, so every unit is cut into other slices
than before. Laying each old slice at its old place in the unit's flat buffer and cutting
that buffer into parameters gives what a checkpoint would hold ("3.weight",
"3.weight/exp_avg"); the new engine then loads it the way it loads any checkpoint
(``ZeroCheckpointState.load_checkpoint_state``), in memory, with no file read.

Which version: every survivor offers each slice it holds with its version (optimizer
steps applied). The group goes on from the furthest survivor's step count (as dp does),
so every old slice must be held at exactly that version by someone; otherwise (two ring
neighbours lost, or a death inside the copy exchange) ``missing_slices`` names the gap
and the run goes back to the checkpoint.
"""

from __future__ import annotations

from typing import Any

import torch

from paratrain.parallel.zero.shard_copies import HeldShard

__all__ = ["InMemoryCheckpoint", "canonical_from_slices", "missing_slices", "pick_slices"]


def missing_slices(world: int, offered: list[dict[int, list[int]]], version: int) -> list[int]:
    """The old replica ranks whose slice no survivor holds at ``version`` (``offered``:
    per survivor, the versions it holds of each replica rank's slice)."""
    return [
        rank
        for rank in range(world)
        if not any(version in versions.get(rank, ()) for versions in offered)
    ]


def pick_slices(held: list[dict[int, list[HeldShard]]], version: int) -> dict[int, HeldShard]:
    """One ``HeldShard`` per old replica rank at ``version`` (the caller checked that each
    is there), the first survivor's that has it."""
    picked: dict[int, HeldShard] = {}
    for holdings in held:
        for rank, shards in holdings.items():
            for shard in shards:
                if shard.version == version and rank not in picked:
                    picked[rank] = shard
    return picked


def canonical_from_slices(
    slices: dict[int, HeldShard], units: list[tuple[list[str], list[torch.Size]]]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(model tensors, optimizer tensors "name/key") from every old replica rank's slice;
    ``units``: each unit's parameter names and shapes, in the order the slices hold them."""
    model: dict[str, torch.Tensor] = {}
    optim: dict[str, torch.Tensor] = {}
    ranks = sorted(slices)
    for index, (names, shapes) in enumerate(units):
        parts = [slices[rank].units[index] for rank in ranks]
        model.update(_cut(torch.cat([p["param"] for p in parts]), names, shapes))
        for key, value in parts[0]["state"].items():
            if isinstance(value, torch.Tensor) and value.shape == parts[0]["param"].shape:
                full = torch.cat([p["state"][key] for p in parts])
                cut = _cut(full, names, shapes)
                optim.update({f"{name}/{key}": tensor for name, tensor in cut.items()})
            else:  # per-parameter bookkeeping (Adam's step): the same on every slice
                scalar = value if isinstance(value, torch.Tensor) else torch.tensor(value)
                optim.update({f"{name}/{key}": scalar.clone() for name in names})
    return model, optim


def _cut(flat: torch.Tensor, names: list[str], shapes: list[torch.Size]) -> dict[str, torch.Tensor]:
    """The parameters laid end to end at the start of ``flat`` (the padding after them)."""
    cut, offset = {}, 0
    for name, shape in zip(names, shapes, strict=True):
        n = shape.numel()
        cut[name] = flat[offset : offset + n].reshape(shape).clone()
        offset += n
    return cut


class InMemoryCheckpoint:
    """What ``load_checkpoint_state`` reads of a checkpoint, held in memory."""

    def __init__(
        self,
        model: dict[str, torch.Tensor],
        optim: dict[str, torch.Tensor],
        groups: list[dict[str, Any]],
    ) -> None:
        self._tensors = {"model": model, "optim": optim}
        self.manifest = {"optimizer": {"param_groups": groups}}

    def names(self, kind: str) -> list[str]:
        return sorted(self._tensors[kind])

    def tensor(self, kind: str, name: str) -> torch.Tensor:
        return self._tensors[kind][name]
