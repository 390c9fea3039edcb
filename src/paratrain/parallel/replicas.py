"""What every data-parallel replica engine (dp, zero1-3) does the same way.

A replica takes its contiguous share of the global batch, and evaluation is that share's
mean loss averaged over the replicas with one all-reduce. Sharding the model state (ZeRO)
changes neither, so both engines inherit them from here rather than each keeping a copy.
So are how a replica starts (``replica_builder``: BatchNorm layers synchronised where
asked, parameters and buffers equal to the first replica's, a random stream of its own,
buffers kept equal as DDP keeps them) and the training step (``data_parallel_step``, with
the strategy's gradient reducer plugged in).

With a tensor degree above 1 the workers form ``replicas x tensor`` (``runtime/mesh``,
tensor innermost): every worker starts from rank 0's model, each tensor group splits its
layers (``tensor/split``) and draws one random stream, and the replicas are each tensor
rank's data-parallel group, so the replicas' reductions, buffers and evaluation below work
over that group unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from paratrain.parallel.batching import batch_size, check_divisible, take_share, to_device
from paratrain.parallel.buffer_sync import BufferBroadcast
from paratrain.parallel.data_parallel_step import DataParallelStep, GradientReducer
from paratrain.parallel.inputs import call_model
from paratrain.parallel.layout import Layout
from paratrain.parallel.loss_reduction import LossTotals
from paratrain.parallel.metric_tally import Metric, Tally
from paratrain.parallel.model_loss_items import part_inputs, with_num_items
from paratrain.parallel.replica_builder import Replica, build_replica, place_replicas
from paratrain.parallel.strategy import StepStats
from paratrain.parallel.tensor import vocab_loss
from paratrain.parallel.tensor.compose import SplitsLayers
from paratrain.runtime import comm


class ReplicaShare(SplitsLayers):
    """Mixin for an Engine whose workers are replicas over ``group``, each replica
    possibly a tensor group splitting its layers.

    The engine calls ``_become_replica`` once, which builds the replica
    (``replica_builder.build_replica``) and sets, from what it returns, every attribute
    the methods here read: ``group``, ``_replicas``, ``_replica_rank``, ``mesh``,
    ``tensor_split``, ``buffer_sync``; then ``_plug_step`` with its gradient reducer, which
    ``train_step`` runs. ``_after_eval`` lets the engine free what evaluation brought in
    (zero3's gathered parameters).
    """

    group: ProcessGroup | None
    degrees: Layout
    _replicas: int
    _replica_rank: int
    _device: torch.device
    buffer_sync: BufferBroadcast | None = None
    data_parallel_step: DataParallelStep

    def _become_replica(
        self,
        model: nn.Module,
        *,
        group: ProcessGroup | None,
        broadcast_buffers: bool,
        sync_batchnorm: bool,
        tp_plan: dict[str, str] | None,
        recompute: bool,
    ) -> Replica:
        """Place this worker and build its replica (``replica_builder``: the steps in
        their order), keeping what the shared methods below read; every worker calls it."""
        place = place_replicas(group, self.degrees)
        self.group, self._replicas, self._replica_rank = place.group, place.replicas, place.rank
        self.mesh = place.mesh
        replica = build_replica(
            model,
            place=place,
            device=self._device,
            broadcast_buffers=broadcast_buffers,
            sync_batchnorm=sync_batchnorm,
            tp_plan=tp_plan,
            recompute=recompute,
        )
        self.tensor_split, self.buffer_sync = replica.tensor_split, replica.buffer_sync
        # a vocab-split lm head keeps its logits split where the loss is ours (vocab_loss)
        self.loss_fn = vocab_loss.sharded_loss(self.loss_fn, replica.model) or self.loss_fn
        return replica

    def tally(self, metric: Metric) -> Tally:
        """As every engine's, after making a vocab-split head's logits whole again: a
        tally reads them (accuracy, its own loss)."""
        self.loss_fn = vocab_loss.gathered(self.loss_fn)
        return super().tally(metric)

    def _plug_step(self, reducer: GradientReducer, forward: Callable[[Any], Any]) -> None:
        """Build this engine's step (``data_parallel_step``) from its replica and the
        gradient reducer its strategy plugs in; called once, at the end of ``__init__``."""
        self.data_parallel_step = DataParallelStep(
            model=self.model,
            forward=forward,
            reducer=reducer,
            optimizer=self.optimizer,
            precision=self.precision,
            memory=self.memory,
            device=self._device,
            replicas=self._replicas,
            gradient_accumulation=self.gradient_accumulation,
            max_grad_norm=self.max_grad_norm,
            share=self._share,
            sync_buffers=self._sync_buffers,
        )

    def train_step(self, inputs: Any, targets: Any) -> StepStats:
        """One step of the shared outline with this engine's reducer."""
        done = self.data_parallel_step.run(
            inputs, targets, loss_fn=self.loss_fn, step=self.steps_taken
        )
        if done.grad_norm is not None:
            self._grad_norm = done.grad_norm
        self.steps_taken += 1
        return self._step_stats(done.loss, done.samples, done.comm_bytes)

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
        """Mean loss over the global batch: each replica's share, averaged over replicas
        (a model's own loss given ``num_items_in_batch``, as in training, so that shares
        unevenly padded average to the global token mean)."""
        replicas = self._replicas
        check_divisible(batch_size(inputs), replicas=replicas, micro_batches=1)
        was_training = self.model.training
        self.model.eval()
        self._sync_buffers(training=False)
        items = with_num_items(self.model, inputs, replicas, self.loss_fn)
        share_in = part_inputs(self._share(inputs), items, replicas)
        share_tgt = self._share(targets)
        totals = LossTotals(self.loss_fn, targets, share_tgt, parts=replicas, device=self._device)
        with self.precision.autocast(self._device):
            totals.add(self.loss_fn(call_model(self.model, share_in), share_tgt))
        loss = totals.contribution().reshape(1)
        self._after_eval()
        self.model.train(was_training)
        if replicas > 1:
            comm.all_reduce_sum(loss, group=self.group)
        return float(loss[0])
