"""What every data-parallel replica engine (dp, zero1-3) does the same way.

A replica takes its contiguous share of the global batch, and evaluation is that share's
mean loss averaged over the replicas with one all-reduce. Sharding the model state (ZeRO)
changes neither, so both engines inherit them from here rather than each keeping a copy.
So is how a replica starts: BatchNorm layers synchronised where asked
(``sync_batchnorm``), parameters and buffers equal to the first replica's, a random
stream of its own (``replica_rng``), and buffers kept equal as DDP keeps them
(``buffer_sync``).

With a tensor degree above 1 the workers form ``replicas x tensor`` (``runtime/mesh``,
tensor innermost): every worker starts from rank 0's model, each tensor group splits its
layers (``tensor/split``) and draws one random stream, and the replicas are each tensor
rank's data-parallel group, so the replicas' reductions, buffers and evaluation below work
over that group unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from paratrain.parallel.batching import batch_size, check_divisible, take_share, to_device
from paratrain.parallel.buffer_sync import BufferBroadcast, buffer_broadcast
from paratrain.parallel.inputs import call_model
from paratrain.parallel.layout import Layout
from paratrain.parallel.loss_reduction import LossTotals
from paratrain.parallel.replica_rng import separate_streams
from paratrain.parallel.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm
from paratrain.parallel.tensor.compose import SplitsLayers
from paratrain.parallel.tensor.split import split_model
from paratrain.runtime import comm
from paratrain.runtime.mesh import build_mesh


class ReplicaShare(SplitsLayers):
    """Mixin for an Engine whose workers are replicas over ``group``, each replica
    possibly a tensor group splitting its layers.

    The engine calls ``_join_replicas`` (which sets ``group``, ``_replicas``,
    ``_replica_rank`` and, where ``degrees`` splits layers, ``mesh``) and then ``_replicate``;
    ``_after_eval`` lets it free what evaluation brought in (zero3's gathered parameters).
    """

    group: ProcessGroup | None
    degrees: Layout
    _replicas: int
    _replica_rank: int
    _device: torch.device
    buffer_sync: BufferBroadcast | None = None

    def _join_replicas(self, group: ProcessGroup | None) -> None:
        """Place this worker among the replicas (and its tensor group, where the layout
        splits layers). Every worker calls it (creating the mesh's groups is collective)."""
        if self.degrees.tp_enabled:
            if group is not None:
                raise ValueError(
                    "group and tensor cannot be combined: the tensor degree lays out the "
                    "replicas' groups itself; leave group out."
                )
            self.mesh = build_mesh(self.degrees)
            group, self._replicas, self._replica_rank = (
                self.mesh.dp_group,
                self.mesh.replicas,
                self.mesh.replica,
            )
        else:
            self._replicas, self._replica_rank = comm.world_size(group), comm.rank(group)
        self.group = group

    def _replicate(
        self,
        model: nn.Module,
        *,
        broadcast_buffers: bool,
        sync_batchnorm: bool,
        tp_plan: dict[str, str] | None = None,
    ) -> nn.Module:
        """``model`` on this replica's device, equal to the first replica's, with its own
        random stream, its layers split where this worker is in a tensor group; every
        worker calls it once ``_join_replicas`` placed it."""
        if sync_batchnorm:
            model = convert_sync_batchnorm(model, group=self.group)
        model = model.to(self._device)
        if self.mesh is not None and self.mesh.tensor > 1:
            # every tensor group cuts its slices from one model, rank 0's
            comm.broadcast_tensors([*model.parameters(), *model.buffers()], src=0)
            separate_streams()
            self.tensor_split = split_model(model, self.mesh, tp_plan=tp_plan)
            self.tensor_split.share_stream(self._device)
        else:
            comm.broadcast_tensors([*model.parameters(), *model.buffers()], src=0, group=self.group)
            separate_streams(group=self.group)
        self.buffer_sync = buffer_broadcast(
            model, group=self.group, enabled=broadcast_buffers, skip=(SyncBatchNorm,)
        )
        return model

    def _sync_buffers(self, *, training: bool) -> None:
        """Before a step's first forward (``training``) or an evaluation: see ``buffer_sync``."""
        if self.buffer_sync is not None:
            self.buffer_sync.before_forward(training=training)

    @property
    def world_size(self) -> int:
        return self._replicas * (self.mesh.tensor if self.mesh is not None else 1)

    def _whole(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A canonical state of this worker's slices made whole (collective over the tensor
        group, so every worker calls ``state_dict``); as it is without a split."""
        return state if self.tensor_split is None else self.tensor_split.whole_state(state)

    def _local(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A whole canonical state cut to this worker's slices."""
        return state if self.tensor_split is None else self.tensor_split.local_state(state)

    def _share(self, batch: Any) -> Any:
        """This replica's contiguous slice of the global batch, on its device."""
        return to_device(take_share(batch, self._replica_rank, self._replicas), self._device)

    def _after_eval(self) -> None:
        """Called after the evaluation forward, before the loss is averaged."""

    def combine_tally(self, sums: torch.Tensor) -> torch.Tensor:
        """Each replica's loss saw its own share of every batch: their sums add up."""
        return self.sum_over_workers(sums, self.group) if self._replicas > 1 else sums

    @torch.no_grad()
    def eval_step(self, inputs: Any, targets: Any) -> float:
        """Mean loss over the global batch: each replica's share, averaged over replicas."""
        replicas = self._replicas
        check_divisible(batch_size(inputs), replicas=replicas, micro_batches=1)
        was_training = self.model.training
        self.model.eval()
        self._sync_buffers(training=False)
        share_in, share_tgt = self._share(inputs), self._share(targets)
        totals = LossTotals(self.loss_fn, targets, share_tgt, parts=replicas, device=self._device)
        with self.precision.autocast(self._device):
            totals.add(self.loss_fn(call_model(self.model, share_in), share_tgt))
        loss = totals.contribution().reshape(1)
        self._after_eval()
        self.model.train(was_training)
        if replicas > 1:
            comm.all_reduce_sum(loss, group=self.group)
        return float(loss[0])
