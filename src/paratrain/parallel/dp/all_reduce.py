"""dp's gradient reducer for the shared step: whole gradients, averaged by all-reduce.

Every replica holds the whole model, so after the bucketed all-reduces
(``grad_buckets``) every replica holds the same whole gradients: the optimizer steps on
them as the plain loop would, the fp16 overflow check needs no message, and clipping is
local. The step's loss rides in the last bucket (armed before the last backward), so it
costs no message of its own. With a single replica there is nothing to reduce.
"""

from __future__ import annotations

import torch
from torch import nn

from paratrain.parallel.clipping import clip_distributed, clip_local
from paratrain.parallel.grad_buckets import BucketedGradientReducer
from paratrain.parallel.loss_reduction import LossTotals
from paratrain.parallel.precision import Precision
from paratrain.parallel.tensor.split import TensorSplit
from paratrain.runtime.mesh import Mesh


class AllReduceGradients:
    """``GradientReducer`` (see ``data_parallel_step``) for replicated parameters."""

    def __init__(
        self,
        model: nn.Module,
        *,
        buckets: BucketedGradientReducer | None,
        optimizer: torch.optim.Optimizer,
        tensor_split: TensorSplit | None,
        mesh: Mesh | None,
        device: torch.device,
    ) -> None:
        self.model, self.buckets, self.optimizer = model, buckets, optimizer
        self.tensor_split, self.mesh, self.device = tensor_split, mesh, device

    def zero_grad(self) -> None:
        if self.buckets is not None:
            self.buckets.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def begin_micro_batch(self, *, last: bool) -> None:
        """Nothing: the buckets' hooks fire during backward."""

    def before_backward(self, scaled: torch.Tensor, totals: LossTotals, *, last: bool) -> None:
        if self.buckets is not None and last:
            self.buckets.arm(extras=totals.contribution())  # rides in the last bucket

    def backward(self, scaled: torch.Tensor) -> None:
        scaled.backward()

    def after_backward(self) -> None:
        """Nothing to release."""

    def finish(self, totals: LossTotals) -> torch.Tensor:
        if self.buckets is not None:
            return self.buckets.finish(extras_count=1)[0]
        return totals.contribution()

    def grads_finite(self, precision: Precision, device: torch.device) -> bool:
        grads = (p.grad for p in self.model.parameters())  # read only under fp16
        # split gradients differ between a tensor group's members: their vote is a message
        return precision.unscale_and_check(grads, synchronized=self.tensor_split is None)

    def clip(self, max_norm: float) -> torch.Tensor | float:
        """Every replica holds the whole gradient after the all-reduce; within a tensor
        group a split parameter's slices add their squares, a replicated one counts once."""
        if self.tensor_split is None:
            return clip_local(self.model.parameters(), max_norm)
        named = [(n, p.grad) for n, p in self.model.named_parameters() if p.grad is not None]
        split, whole = self.tensor_split.partition(named)
        return clip_distributed(
            split,
            max_norm,
            device=self.device,
            group=self.mesh.tensor_group,
            shared=whole,
            shared_by=self.mesh.tensor,
        )

    def after_optimizer_step(self) -> None:
        """Nothing: the parameters were updated in place on every replica alike."""
