"""Parallel degrees -> named process groups.

Ranks are laid out with the pipeline stage varying fastest: rank = replica * stages + stage.
Neighbouring stages of one pipeline are then neighbouring ranks (on one host, and on one
node of a multi-node job when stages <= GPUs per node), and every stage's data-parallel
group strides across pipelines. Degrees that do not multiply to the device count are
refused with a sentence saying what would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup


class MeshError(ValueError):
    """Parallel degrees that do not fit the number of workers."""


def check_degrees(world_size: int, *, stages: int) -> int:
    """Return the data-parallel degree, or refuse degrees that do not fit ``world_size``."""
    if stages < 1:
        raise MeshError(f"stages must be at least 1, not {stages}.")
    if world_size % stages:
        fits = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise MeshError(
            f"{stages} pipeline stages do not divide {world_size} workers evenly; use a stage "
            f"count among {fits} or a multiple of {stages} workers."
        )
    return world_size // stages


@dataclass
class PipelineMesh:
    """This worker's place in a (replicas x stages) grid, with its process groups."""

    stages: int
    replicas: int
    stage: int
    replica: int
    dp_group: ProcessGroup | None

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    def rank_of(self, stage: int, replica: int | None = None) -> int:
        """Global rank of ``stage`` in ``replica`` (this worker's replica by default)."""
        replica = self.replica if replica is None else replica
        return replica * self.stages + stage

    @property
    def prev_rank(self) -> int:
        return self.rank_of(self.stage - 1)

    @property
    def next_rank(self) -> int:
        return self.rank_of(self.stage + 1)


def pipeline_mesh(stages: int) -> PipelineMesh:
    """This job's mesh; every rank must call it, since creating groups is collective."""
    world, rank = dist.get_world_size(), dist.get_rank()
    replicas = check_degrees(world, stages=stages)
    stage, replica = rank % stages, rank // stages
    dp_group = None
    for each_stage in range(stages):
        members = [r * stages + each_stage for r in range(replicas)]
        group = dist.new_group(members) if replicas > 1 else None
        if each_stage == stage:
            dp_group = group
    return PipelineMesh(stages, replicas, stage, replica, dp_group)
