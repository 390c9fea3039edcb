"""One data-parallel training step, written once, with the gradient reducer plugged in.

dp and zero1-3 run the same step: take this replica's share of the global batch, cut it
into ``gradient_accumulation`` micro-batches, run forward and backward on each with the
loss scaled so that the replicas' gradients add up to the global batch's mean, reduce the
gradients over the replicas, let the precision vote on skipping an overflowing fp16
step, clip, step the optimizer. What differs is where a gradient goes after backward and
what the optimizer updates: dp all-reduces whole gradients in buckets
(``dp/all_reduce.py``), ZeRO reduce-scatters flat units into shards and gathers the
updated slices back (``zero/reduce_scatter.py``). That difference is a ``GradientReducer``
passed to ``DataParallelStep``; the outline below never asks which one it holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from paratrain.parallel.batching import batch_size, check_divisible, split_micro
from paratrain.parallel.loss_reduction import LossTotals
from paratrain.parallel.memory_tracking import MemoryTracker
from paratrain.parallel.model_loss_items import part_inputs, with_num_items
from paratrain.parallel.precision import Precision
from paratrain.runtime import comm


class GradientReducer(Protocol):
    """Where a replica's gradients go and how the step reads them back; the hooks are
    called in the order listed, each at the point of the step its name says."""

    def zero_grad(self) -> None:
        """Before the step's first forward: no gradient left from the last step."""

    def begin_micro_batch(self, *, last: bool) -> None:
        """Before micro-batch's forward (``last``: the step's final one, whose backward
        reduces)."""

    def before_backward(self, scaled: torch.Tensor, totals: LossTotals, *, last: bool) -> None:
        """With the micro-batch's scaled loss in hand, before its backward."""

    def backward(self, scaled: torch.Tensor) -> None:
        """Run backward of ``scaled`` (within whatever context the reducer needs)."""

    def after_backward(self) -> None:
        """After the micro-batch's backward and the ledger's release of its activations."""

    def finish(self, totals: LossTotals) -> torch.Tensor | float:
        """Wait for every reduction; return the global batch's mean loss (the replicas'
        contributions summed, where the reduction carries them). A tensor is read by the
        step after the optimizer's work is queued, so the read does not idle the device."""

    def grads_finite(self, precision: Precision, device: torch.device) -> bool:
        """Unscale fp16 gradients and say whether every worker steps (one vote for all)."""

    def clip(self, max_norm: float) -> torch.Tensor | float:
        """Clip the global gradient norm to ``max_norm``; return the norm before it (a
        tensor read as ``finish``'s loss is)."""

    def after_optimizer_step(self) -> None:
        """After the optimizer stepped (ZeRO stages 1-2 gather the updated slices)."""


@dataclass(frozen=True)
class StepOutcome:
    """What one step measured, for the engine's ``StepStats``."""

    loss: float
    samples: int
    comm_bytes: int
    grad_norm: float | None
    """The norm before clipping, where the step clipped; None otherwise."""


@dataclass(frozen=True)
class DataParallelStep:
    """The fixed parts of a replica's step, built once by its engine."""

    model: nn.Module
    forward: Callable[[Any], Any]
    """The model's training forward on one micro-batch (recompute and zero3's gathering
    inside)."""
    reducer: GradientReducer
    optimizer: torch.optim.Optimizer
    precision: Precision
    memory: MemoryTracker
    device: torch.device
    replicas: int
    gradient_accumulation: int
    max_grad_norm: float | None
    share: Callable[[Any], Any]
    """This replica's share of a global batch, on its device."""
    sync_buffers: Callable[..., None]
    """``sync_buffers(training=True)`` before the step's first forward (``buffer_sync``)."""

    def run(self, inputs: Any, targets: Any, *, loss_fn: Any, step: int) -> StepOutcome:
        """One optimizer step on the global batch (``step``: steps taken before it;
        ``loss_fn``: the engine's, read per step as a tally may wrap it)."""
        samples = batch_size(inputs)
        replicas, k = self.replicas, self.gradient_accumulation
        check_divisible(samples, replicas=replicas, micro_batches=k)
        bytes_before = comm.bytes_sent()
        share_in, share_tgt = self.share(inputs), self.share(targets)
        self.model.train()
        self.reducer.zero_grad()
        self.memory.begin_step(step)
        scale = 1.0 / (k * replicas)
        backward_scale = self.precision.loss_factor(scale)
        totals = LossTotals(loss_fn, targets, share_tgt, parts=k * replicas, device=self.device)
        self.sync_buffers(training=True)
        items = with_num_items(self.model, inputs, k * replicas, loss_fn)
        micro = zip(split_micro(share_in, k), split_micro(share_tgt, k), strict=True)
        for index, (micro_in, micro_tgt) in enumerate(micro):
            last = index == k - 1
            self.reducer.begin_micro_batch(last=last)
            micro_in = part_inputs(micro_in, items, k * replicas)
            with self.memory.forward(index), self.precision.autocast(self.device):
                loss = totals.add(loss_fn(self.forward(micro_in), micro_tgt))
            scaled = totals.scaled(loss, backward_scale, self.precision.loss_factor())
            self.reducer.before_backward(scaled, totals, last=last)
            self.reducer.backward(scaled)
            self.memory.release(index)
            self.reducer.after_backward()
        mean_loss = self.reducer.finish(totals)
        grad_norm = None
        if self.reducer.grads_finite(self.precision, self.device):
            if self.max_grad_norm is not None:
                grad_norm = self.reducer.clip(self.max_grad_norm)
            self.optimizer.step()
            self.reducer.after_optimizer_step()
        self.memory.end_step()
        sent = comm.bytes_sent() - bytes_before
        norm = None if grad_norm is None else float(grad_norm)
        return StepOutcome(float(mean_loss), samples, sent, norm)
