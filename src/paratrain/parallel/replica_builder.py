"""How a data-parallel replica is built, as one function read top to bottom.

A replica engine (dp, zero1-3, a pipeline stage's replicas) turns the user's model into
this worker's replica by a fixed sequence of steps, and their order matters: BatchNorm
layers become synchronised before the model moves (the new layers must move too); every
worker must hold the first replica's values before a tensor group cuts its slices (or
the slices would come from different models); each worker draws its own random stream
only once the broadcast that consumed the shared one is done; the buffers kept equal are
those of the final, split model; recompute's segments wrap the split layers.

``place_replicas`` says where this worker sits (its replicas' group, their count, its
rank among them, the mesh where layers split), ``build_replica`` applies the steps in
that order with every input passed in, and ``replicate_stage`` is the pipeline's version
for a stage already cut and placed. Nothing here reads or sets an engine's attributes:
the engine keeps what comes back (as torchtitan's ``parallelize_llama`` applies tensor
parallelism, then recompute, then data parallelism, in one visible function).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from paratrain.parallel.buffer_sync import BufferBroadcast, buffer_broadcast
from paratrain.parallel.grad_buckets import BucketedGradientReducer, MiB
from paratrain.parallel.layout import Layout
from paratrain.parallel.recompute import recomputing_forward
from paratrain.parallel.replica_rng import separate_streams
from paratrain.parallel.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm
from paratrain.parallel.tensor.split import TensorSplit, split_model
from paratrain.runtime import comm
from paratrain.runtime.mesh import Mesh, build_mesh


@dataclass(frozen=True)
class ReplicaPlace:
    """Where this worker sits among the replicas."""

    group: ProcessGroup | None
    """The replicas' process group (a tensor rank's data-parallel group under a split)."""
    replicas: int
    """How many replicas split the global batch."""
    rank: int
    """This worker's replica index: which contiguous share of the batch it takes."""
    mesh: Mesh | None
    """``replicas x tensor`` where layers split; None otherwise."""

    @property
    def splits_layers(self) -> bool:
        return self.mesh is not None and self.mesh.tensor > 1


def place_replicas(group: ProcessGroup | None, layout: Layout) -> ReplicaPlace:
    """This worker's place in ``layout`` (``group``: the user's replicas, the whole job by
    default). Every worker calls it: creating the mesh's groups is collective."""
    if layout.tp_enabled:
        if group is not None:
            raise ValueError(
                "group and tensor cannot be combined: the tensor degree lays out the "
                "replicas' groups itself; leave group out."
            )
        mesh = build_mesh(layout)
        return ReplicaPlace(mesh.dp_group, mesh.replicas, mesh.replica, mesh)
    return ReplicaPlace(group, comm.world_size(group), comm.rank(group), None)


@dataclass(frozen=True)
class Replica:
    """What ``build_replica`` made of the user's model on this worker."""

    model: nn.Module
    """The replica itself: synchronised BatchNorm where asked, on the device, equal to the
    first replica's, its planned layers split where the place has a tensor group."""
    tensor_split: TensorSplit | None
    """This worker's slices of the split layers (None without a tensor group)."""
    buffer_sync: BufferBroadcast | None
    """The first replica's buffers sent to the others before forwards (None: nothing to
    send, or ``broadcast_buffers=False``)."""
    forward: Callable[[Any], Any] | nn.Module
    """What a training forward calls: the model, or its recomputed segments."""


def build_replica(
    model: nn.Module,
    *,
    place: ReplicaPlace,
    device: torch.device,
    broadcast_buffers: bool,
    sync_batchnorm: bool,
    tp_plan: dict[str, str] | str | None,
    recompute: bool,
) -> Replica:
    """``model`` made this worker's replica; every worker calls it once placed. The steps,
    in their order: sync BatchNorm, device, broadcast (and, under a split, the tensor
    cut), random stream, buffer sync, recompute."""
    if sync_batchnorm:
        model = convert_sync_batchnorm(model, group=place.group)
    model = model.to(device)
    tensor_split = None
    if place.splits_layers:
        # every tensor group cuts its slices from one model, rank 0's
        broadcast_from_first([*model.parameters(), *model.buffers()], group=None)
        separate_streams()
        tensor_split = split_model(model, place.mesh, tp_plan=tp_plan)
        tensor_split.share_stream(device)
    else:
        broadcast_from_first([*model.parameters(), *model.buffers()], group=place.group)
        separate_streams(group=place.group)
    buffer_sync = buffer_broadcast(
        model, group=place.group, enabled=broadcast_buffers, skip=(SyncBatchNorm,)
    )
    forward = recomputing_forward(model) if recompute else model
    return Replica(model, tensor_split, buffer_sync, forward)


def broadcast_from_first(tensors: list[torch.Tensor], *, group: ProcessGroup | None) -> None:
    """``tensors`` made equal to the group's first member's (the whole job's: ``None``)."""
    comm.broadcast_tensors(tensors, src=0, group=group)


@dataclass(frozen=True)
class StageReplicas:
    """What the replicas of one pipeline stage share: buffers kept equal, gradients
    averaged (both None with a single replica)."""

    buffer_sync: BufferBroadcast | None
    reducer: BucketedGradientReducer | None


def replicate_stage(
    parameters: list[nn.Parameter],
    buffers: list[torch.Tensor],
    *,
    mesh: Mesh,
    bucket_mb: float,
) -> StageReplicas:
    """A pipeline stage (already cut, on its device) made equal over its replicas, the
    first replica's running statistics sent before each step and evaluation as DDP's
    default, and its gradients averaged by the dp engine's buckets. Every worker calls
    it; with one replica it sends nothing."""
    if mesh.replicas == 1:
        return StageReplicas(None, None)
    broadcast_from_first([*parameters, *buffers], group=mesh.dp_group)
    buffer_sync = BufferBroadcast(buffers, group=mesh.dp_group) if buffers else None
    reducer = BucketedGradientReducer(
        list(parameters),
        group=mesh.dp_group,
        bucket_bytes=int(bucket_mb * MiB),
        first_bucket_bytes=int(bucket_mb * MiB),
    )
    return StageReplicas(buffer_sync, reducer)
