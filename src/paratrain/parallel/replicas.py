"""What every data-parallel replica engine (dp, zero1-3) does the same way.

A replica takes its contiguous share of the global batch, and evaluation is that share's
mean loss averaged over the replicas with one all-reduce. Sharding the model state (ZeRO)
changes neither, so both engines inherit them from here rather than each keeping a copy.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ProcessGroup

from paratrain.parallel.batching import batch_size, check_divisible, take_share, to_device
from paratrain.parallel.inputs import call_model
from paratrain.runtime import comm


class ReplicaShare:
    """Mixin for an Engine whose workers are replicas over ``group``.

    The engine sets ``group``, ``_replicas`` and ``_replica_rank``; ``_after_eval`` lets it
    free what evaluation brought in (zero3's gathered parameters).
    """

    group: ProcessGroup | None
    _replicas: int
    _replica_rank: int

    @property
    def world_size(self) -> int:
        return self._replicas

    def _share(self, batch: Any) -> Any:
        """This replica's contiguous slice of the global batch, on its device."""
        return to_device(take_share(batch, self._replica_rank, self._replicas), self._device)

    def _after_eval(self) -> None:
        """Called after the evaluation forward, before the loss is averaged."""

    @torch.no_grad()
    def eval_step(self, inputs: Any, targets: Any) -> float:
        """Mean loss over the global batch: each replica's share, averaged over replicas."""
        replicas = self._replicas
        check_divisible(batch_size(inputs), replicas=replicas, micro_batches=1)
        was_training = self.model.training
        self.model.eval()
        share_in, share_tgt = self._share(inputs), self._share(targets)
        with self.precision.autocast(self._device):
            loss = self.loss_fn(call_model(self.model, share_in), share_tgt)
        loss = loss.detach().float().reshape(1) / replicas
        self._after_eval()
        self.model.train(was_training)
        if replicas > 1:
            comm.all_reduce_sum(loss, group=self.group)
        return float(loss[0])
