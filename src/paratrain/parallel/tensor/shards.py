"""How one parameter is cut over the tensor group, and put back together.

A split parameter is cut along one dimension into ``tensor`` equal slices, rank ``r``
holding slice ``r``. A fused parameter stacks several blocks along that dimension (gpt's
``qkv.weight``: the query, key and value rows); cutting the fused matrix as a whole would
give rank 0 all of q and half of k, so each block is cut on its own and a rank holds its
slice of every block, in block order (its heads of q, then of k, then of v).

``take`` and ``join`` are exact inverses, and are what state dicts, checkpoints and
optimizer state go through, so a checkpoint holds the tensors the single-device model has.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardSpec:
    """Parameter cut along ``dim`` into ``parts`` slices, each block of ``blocks`` alike."""

    dim: int
    parts: int
    blocks: int = 1

    def take(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s slice of the full tensor (a contiguous copy)."""
        pieces = [
            block.chunk(self.parts, dim=self.dim)[rank]
            for block in full.chunk(self.blocks, dim=self.dim)
        ]
        return torch.cat(pieces, dim=self.dim).contiguous()

    def join(self, slices: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's slice, in rank order."""
        per_rank = [piece.chunk(self.blocks, dim=self.dim) for piece in slices]
        return torch.cat(
            [per_rank[rank][block] for block in range(self.blocks) for rank in range(self.parts)],
            dim=self.dim,
        )

    def full_shape(self, local: torch.Size) -> torch.Size:
        """The full tensor's shape from a slice's."""
        shape = list(local)
        shape[self.dim] *= self.parts
        return torch.Size(shape)
