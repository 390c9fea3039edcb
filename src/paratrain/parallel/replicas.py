"""What every data-parallel replica engine (dp, zero1-3) does the same way.

A replica takes its contiguous share of the global batch, and evaluation is that share's
mean loss averaged over the replicas with one all-reduce. Sharding the model state (ZeRO)
changes neither, so both engines inherit them from here rather than each keeping a copy.
So is how a replica starts: BatchNorm layers synchronised where asked
(``sync_batchnorm``), parameters and buffers equal to the first replica's, a random
stream of its own (``replica_rng``), and buffers kept equal as DDP keeps them
(``buffer_sync``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from paratrain.parallel.batching import batch_size, check_divisible, take_share, to_device
from paratrain.parallel.buffer_sync import BufferBroadcast, buffer_broadcast
from paratrain.parallel.inputs import call_model
from paratrain.parallel.loss_reduction import LossTotals
from paratrain.parallel.replica_rng import separate_streams
from paratrain.parallel.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm
from paratrain.runtime import comm


class ReplicaShare:
    """Mixin for an Engine whose workers are replicas over ``group``.

    The engine sets ``group``, ``_replicas`` and ``_replica_rank``; ``_after_eval`` lets it
    free what evaluation brought in (zero3's gathered parameters).
    """

    group: ProcessGroup | None
    _replicas: int
    _replica_rank: int
    _device: torch.device
    buffer_sync: BufferBroadcast | None = None

    def _replicate(
        self, model: nn.Module, *, broadcast_buffers: bool, sync_batchnorm: bool
    ) -> nn.Module:
        """``model`` on this replica's device, equal to the first replica's, with its own
        random stream; every replica calls it once ``group`` is set."""
        if sync_batchnorm:
            model = convert_sync_batchnorm(model, group=self.group)
        model = model.to(self._device)
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
        return self._replicas

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
