"""The (replicas x tensor) grid: tensor innermost, so a tensor group is neighbouring ranks.

``rank = replica * tensor + tensor_rank``: the workers that split one layer sit next to
each other (on one host, or one node's NVLink when ``tensor`` <= GPUs per node, where
their per-layer all-reduces belong), and each tensor rank's data-parallel group strides
across the replicas, carrying one gradient all-reduce per step. Degrees that do not fit
the worker count are refused with a sentence saying which would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup

from paratrain.runtime import comm


def check_mesh(devices: int, tensor: int | None) -> int:
    """The tensor degree (every device when None); one that does not divide is refused."""
    tensor = devices if tensor is None else tensor
    if tensor < 1 or devices % tensor:
        fits = [d for d in range(1, devices + 1) if devices % d == 0]
        raise ValueError(
            f"tensor={tensor} does not divide {devices} workers into equal tensor groups; "
            f"choose tensor among {fits}, or run on a multiple of {tensor} workers."
        )
    if tensor == 1 < devices:
        raise ValueError(
            f"tensor=1 splits no layer over {devices} workers; choose strategy 'dp' for "
            "replicas alone, or a tensor of 2 or more."
        )
    return tensor


@dataclass(frozen=True)
class TensorMesh:
    """This worker's place in the grid and its two groups (None: the whole job, or none
    needed where the dimension has size 1)."""

    tensor: int
    replicas: int
    tensor_rank: int
    replica: int
    tensor_group: ProcessGroup | None
    data_group: ProcessGroup | None

    def describe(self) -> str:
        return f"{self.replicas} replicas x {self.tensor} tensor"


def tensor_mesh(tensor: int | None) -> TensorMesh:
    """This job's mesh; every worker calls it (creating groups is collective)."""
    world, rank = comm.world_size(), comm.rank()
    tensor = check_mesh(world, tensor)
    replicas = world // tensor
    tensor_group = data_group = None
    if 1 < tensor < world:  # every worker creates every group, in the same order
        for replica in range(replicas):
            group = dist.new_group([replica * tensor + t for t in range(tensor)])
            if replica == rank // tensor:
                tensor_group = group
    if 1 < replicas < world:
        for t in range(tensor):
            group = dist.new_group([replica * tensor + t for replica in range(replicas)])
            if t == rank % tensor:
                data_group = group
    return TensorMesh(tensor, replicas, rank % tensor, rank // tensor, tensor_group, data_group)
