"""Parallel degrees -> named process groups: the (replicas x stages x tensor) grid.

Ranks are laid out with the tensor rank varying fastest, then the pipeline stage:
``rank = (replica * stages + stage) * tensor + tensor_rank``, the order torchtitan and
Megatron use. The workers that split one layer (a tensor group) are then neighbouring
ranks, on one host or one node's NVLink, where their per-layer all-reduces belong; the
stages of one pipeline come next, exchanging one activation per micro-batch; and each
(stage, tensor rank)'s data-parallel group strides across the replicas, carrying one
gradient all-reduce per step. The degrees come checked, from a ``Layout``
(``parallel/layout.py``), the one place that refuses degrees the device count does not fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch.distributed as dist
from torch.distributed import ProcessGroup


class Degrees(Protocol):
    """What a mesh is built from: ``parallel.layout.Layout`` (runtime imports nothing
    above it, so it names the fields it reads rather than the class)."""

    replicas: int
    stages: int
    tensor: int


@dataclass(frozen=True)
class Mesh:
    """This worker's place in the grid, with its process groups (None: the whole job, or
    none needed where the group would hold one worker)."""

    replicas: int
    stages: int
    tensor: int
    replica: int
    stage: int
    tensor_rank: int
    dp_group: ProcessGroup | None
    """The replicas of this worker's (stage, tensor rank): they average its gradients."""
    tensor_group: ProcessGroup | None
    """The workers splitting this worker's layers (same replica and stage)."""

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    def rank_of(
        self, stage: int, replica: int | None = None, tensor_rank: int | None = None
    ) -> int:
        """Global rank of ``stage`` in ``replica`` at ``tensor_rank`` (this worker's
        replica and tensor rank by default)."""
        replica = self.replica if replica is None else replica
        tensor_rank = self.tensor_rank if tensor_rank is None else tensor_rank
        return (replica * self.stages + stage) * self.tensor + tensor_rank

    @property
    def prev_rank(self) -> int:
        """The previous stage's worker at this tensor rank (a stage sends to its twin)."""
        return self.rank_of(self.stage - 1)

    @property
    def next_rank(self) -> int:
        return self.rank_of(self.stage + 1)

    def describe(self) -> str:
        """``2 replicas x 2 stages x 2 tensor``: replicas always, other degrees where > 1."""
        parts = [f"{self.replicas} replica{'s' if self.replicas != 1 else ''}"]
        if self.stages > 1:
            parts.append(f"{self.stages} stages")
        if self.tensor > 1:
            parts.append(f"{self.tensor} tensor")
        return " x ".join(parts)


def build_mesh(layout: Degrees) -> Mesh:
    """This job's mesh for ``layout``; every rank must call it, since creating groups is
    collective (every worker creates every group, in the same order)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    replicas, stages, tensor = layout.replicas, layout.stages, layout.tensor
    if replicas * stages * tensor != world:
        raise ValueError(
            f"a layout of {replicas} x {stages} x {tensor} workers was built for another "
            f"job than this one of {world}; build it from this job's size."
        )
    tensor_rank = rank % tensor
    stage = (rank // tensor) % stages
    replica = rank // (tensor * stages)

    def rank_at(replica: int, stage: int, t: int) -> int:
        return (replica * stages + stage) * tensor + t

    dp_group = tensor_group = None
    if 1 < replicas < world:
        for each_stage in range(stages):
            for t in range(tensor):
                group = dist.new_group([rank_at(r, each_stage, t) for r in range(replicas)])
                if (each_stage, t) == (stage, tensor_rank):
                    dp_group = group
    if 1 < tensor < world:
        for r in range(replicas):
            for each_stage in range(stages):
                group = dist.new_group([rank_at(r, each_stage, t) for t in range(tensor)])
                if (r, each_stage) == (replica, stage):
                    tensor_group = group
    return Mesh(replicas, stages, tensor, replica, stage, tensor_rank, dp_group, tensor_group)
