"""BatchNorm over the whole global batch on gloo: statistics all-reduced across replicas.

Why: with the batch split over replicas, each replica's BatchNorm normalises by the mean
and variance of its own share, so a model trains differently at every device count.
torch's ``SyncBatchNorm`` fixes that only on GPUs (on CPU workers it raises "expected
input tensor to be on GPU"). ``sync_batchnorm=True`` (dp, zero1-3) converts the model's
``nn.BatchNorm1d/2d/3d`` layers into ``SyncBatchNorm`` below, after which training equals
full-batch BatchNorm on one device, running statistics included.

How: forward all-reduces, per channel, the sum and the sum of squares of the replica's
input together with its element count (one message of 2C + 1 values), and normalises by
the global mean and biased variance; running statistics take the unbiased variance with
the global count, as one device does with the whole batch. Backward all-reduces, per
channel, the sums of ``dy`` and ``dy * x_hat`` (2C values), the two terms of the input
gradient that couple the samples; the weight and bias gradients stay each replica's own,
as every parameter's gradient does before the engine averages it. The sums are taken in
float64: the variance as E[x^2] - E[x]^2 would otherwise lose digits to cancellation
whenever the mean is large against the spread (torch's CPU kernel accumulates in float64
too).

The converted module keeps the parameter and buffer names (``weight``, ``bias``,
``running_mean``, ``running_var``, ``num_batches_tracked``) and the very same tensors,
so checkpoints load into the original model and the optimizer sees the same parameters.

With ``gradient_accumulation`` k, each forward normalises over the j-th micro-batch of
every replica together; the single-device engine's j-th micro-batch is a different set of
samples, so the two agree only for k = 1.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.nn.modules.batchnorm import _BatchNorm

from paratrain.parallel.options import StrategyOption
from paratrain.runtime import comm

SYNC_BATCHNORM = StrategyOption(
    "sync_batchnorm",
    bool,
    False,
    "BatchNorm statistics over the global batch (all-reduced across replicas), as on one device",
)
"""The option of every replica engine (dp, zero1-3); one meaning for all."""

INPUT_DIMS: dict[type[nn.Module], tuple[int, ...]] = {
    nn.BatchNorm1d: (2, 3),
    nn.BatchNorm2d: (4,),
    nn.BatchNorm3d: (5,),
}
"""The layers converted (exactly these types: a subclass may change the forward), and the
input ranks each accepts."""


def _channel_shape(x: torch.Tensor) -> list[int]:
    """The shape that broadcasts a per-channel vector against ``x`` (channels on dim 1)."""
    return [1, x.shape[1], *([1] * (x.dim() - 2))]


def _reduced_dims(x: torch.Tensor) -> list[int]:
    """Every dimension but the channels'."""
    return [0, *range(2, x.dim())]


def global_moments(
    x: torch.Tensor, group: ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Per-channel mean and biased variance over every replica's ``x``, and the count.

    Float64, from one all-reduce of the sums, the sums of squares and the element count.
    """
    channels = x.shape[1]
    wide = x.detach().double()
    dims = _reduced_dims(x)
    count = torch.tensor([x.numel() / channels], dtype=torch.float64, device=x.device)
    stats = torch.cat([wide.sum(dims), (wide * wide).sum(dims), count])
    if comm.world_size(group) > 1:
        comm.all_reduce_sum(stats, group=group)
    total = float(stats[-1])
    mean = stats[:channels] / total
    variance = (stats[channels : 2 * channels] / total - mean * mean).clamp_min(0.0)
    return mean, variance, total


class _Normalize(torch.autograd.Function):
    """y = (x - mean) * invstd * weight + bias with the global mean and invstd; backward
    completes the input gradient with the globally summed coupling terms."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        mean: torch.Tensor,
        invstd: torch.Tensor,
        count: float,
        group: ProcessGroup | None,
    ) -> torch.Tensor:
        shape = _channel_shape(x)
        y = (x.double() - mean.view(shape)) * invstd.view(shape)
        if weight is not None:
            y = y * weight.double().view(shape)
        if bias is not None:
            y = y + bias.double().view(shape)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.count, ctx.group = count, group
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):  # type: ignore[override]
        x, weight, mean, invstd = ctx.saved_tensors
        shape, dims = _channel_shape(x), _reduced_dims(x)
        x_hat = (x.double() - mean.view(shape)) * invstd.view(shape)
        wide_dy = dy.double()
        sum_dy = wide_dy.sum(dims)
        sum_dy_x_hat = (wide_dy * x_hat).sum(dims)
        grad_weight = sum_dy_x_hat.to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_bias = sum_dy.to(weight.dtype) if ctx.needs_input_grad[2] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            channels = x.shape[1]
            coupling = torch.cat([sum_dy, sum_dy_x_hat])
            if comm.world_size(ctx.group) > 1:
                comm.all_reduce_sum(coupling, group=ctx.group)
            mean_dy = (coupling[:channels] / ctx.count).view(shape)
            mean_dy_x_hat = (coupling[channels:] / ctx.count).view(shape)
            scale = invstd if weight is None else invstd * weight.double()
            grad_x = ((wide_dy - mean_dy - x_hat * mean_dy_x_hat) * scale.view(shape)).to(x.dtype)
        return grad_x, grad_weight, grad_bias, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """A BatchNorm layer whose training statistics span every replica of ``group``.

    Built by ``convert_sync_batchnorm`` from an ``nn.BatchNorm1d/2d/3d``; it accepts the
    input ranks its original did. In evaluation (with running statistics) it is the
    original layer exactly, with no message.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        *,
        input_dims: tuple[int, ...],
        group: ProcessGroup | None = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.input_dims = input_dims
        self.group = group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() not in self.input_dims:
            ranks = " or ".join(f"{d}D" for d in self.input_dims)
            raise ValueError(f"expected {ranks} input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        uses_batch_statistics = self.training or self.running_mean is None
        if not uses_batch_statistics:
            return F.batch_norm(
                input,
                self.running_mean,
                self.running_var,
                self.weight,
                self.bias,
                False,
                0.0,
                self.eps,
            )
        mean, variance, count = global_moments(input, self.group)
        if count <= 1:
            raise ValueError(
                f"Expected more than 1 value per channel when training, got {int(count)} over "
                "all replicas; use a larger global batch."
            )
        if self.training and self.running_mean is not None:
            self._update_running_statistics(mean, variance, count)
        invstd = torch.rsqrt(variance + self.eps)
        return _Normalize.apply(input, self.weight, self.bias, mean, invstd, count, self.group)

    @torch.no_grad()
    def _update_running_statistics(
        self, mean: torch.Tensor, variance: torch.Tensor, count: float
    ) -> None:
        """As ``nn.BatchNorm`` updates them, with the global batch's mean and variance."""
        factor = 0.0 if self.momentum is None else self.momentum
        if self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        unbiased = variance * (count / (count - 1))
        for buffer, value in ((self.running_mean, mean), (self.running_var, unbiased)):
            buffer.copy_(buffer.double() * (1.0 - factor) + value * factor)


def convert_sync_batchnorm(model: nn.Module, *, group: ProcessGroup | None) -> nn.Module:
    """``model`` with each ``nn.BatchNorm1d/2d/3d`` replaced, in place, by a
    ``SyncBatchNorm`` over ``group`` holding the same parameters and buffers (returned:
    a model that is itself a BatchNorm layer is replaced as a whole)."""
    converted: dict[int, nn.Module] = {}  # a layer used twice is converted once

    def convert(module: nn.Module) -> nn.Module:
        if id(module) in converted:
            return converted[id(module)]
        if type(module) in INPUT_DIMS:
            result = _synchronized(module, group)
        else:
            result = module
            for name, child in module.named_children():
                new = convert(child)
                if new is not child:
                    setattr(module, name, new)
        converted[id(module)] = result
        return result

    return convert(model)


def _synchronized(norm: _BatchNorm, group: ProcessGroup | None) -> SyncBatchNorm:
    """The synchronised twin of ``norm``, sharing its tensors."""
    sync = SyncBatchNorm(
        norm.num_features,
        norm.eps,
        norm.momentum,
        norm.affine,
        norm.track_running_stats,
        input_dims=INPUT_DIMS[type(norm)],
        group=group,
    )
    for name, parameter in norm.named_parameters(recurse=False):
        setattr(sync, name, parameter)
    for name, buffer in norm.named_buffers(recurse=False):
        setattr(sync, name, buffer)
    sync.train(norm.training)
    return sync
