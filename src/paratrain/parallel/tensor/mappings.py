"""Megatron's two conjugate operators on the tensor group (``mappings.py`` there).

``copy_to_tensor_group`` (``f``) sits before a column-split layer: every rank already holds
the whole input, so forward is the identity; each rank's backward only sees the gradient
through its own output columns, so the input's gradient is the sum over ranks (one
all-reduce). ``reduce_from_tensor_group`` (``g``) sits after a row-split layer: each rank
computed a partial product over its input slice, so forward sums them (one all-reduce);
every rank then holds the whole output, whose gradient is already whole: backward is the
identity. A colwise/rowwise pair therefore costs one all-reduce forward and one backward.

``gather_from_tensor_group`` joins the members' slices of the last dimension (a
vocabulary-split head's logits, for a loss that needs them all): all-gather forward, this
member's slice of the gradient backward.

``CALLS`` counts them and ``BYTES`` their payload, so tests (and the run summary) can check
those counts. A layer split with ``group=LOCAL`` runs on one process as one member of a
tensor group would, its operators counting what they would send and sending nothing: the
planner measures a split model's memory and compute that way, without workers.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.distributed import ProcessGroup

from paratrain.runtime import comm
from paratrain.runtime.untraced import untraced

CALLS: Counter[str] = Counter()
"""All-reduces issued by the two operators, by direction ("forward", "backward")."""
BYTES: Counter[str] = Counter()
"""Their payload bytes, by direction."""
LOCAL: Any = "local tensor group"
"""A tensor group simulated on one process (see the module docstring)."""


@untraced
def _summed(tensor: torch.Tensor, group: ProcessGroup | None, direction: str) -> torch.Tensor:
    """A contiguous copy of ``tensor`` summed over ``group`` (gloo mishandles strided
    tensors in some collectives; the copy also leaves autograd's tensor untouched)."""
    out = tensor.contiguous().clone()
    CALLS[direction] += 1
    BYTES[direction] += out.numel() * out.element_size()
    if group is not LOCAL:
        comm.all_reduce_sum(out, group=group)
    return out


class _CopyToTensorGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _summed(grad, ctx.group, "backward"), None


class _ReduceFromTensorGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        return _summed(x, group, "forward")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_tensor_group(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """``f``: identity forward, all-reduce of the gradient backward."""
    return _CopyToTensorGroup.apply(x, group)


def reduce_from_tensor_group(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """``g``: all-reduce forward, identity backward."""
    return _ReduceFromTensorGroup.apply(x, group)


class _GatherFromTensorGroup(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: ProcessGroup | None, rank: int, parts: int
    ) -> torch.Tensor:
        ctx.rank, ctx.width = rank, x.shape[-1]
        return _gathered_last(x, group, rank, parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        start = ctx.rank * ctx.width
        return grad[..., start : start + ctx.width].contiguous(), None, None, None


@untraced
def _gathered_last(
    x: torch.Tensor, group: ProcessGroup | None, rank: int, parts: int
) -> torch.Tensor:
    """Every member's ``x`` joined along the last dimension, in rank order (``LOCAL``: this
    member's slice in place, zeros for the others, the bytes counted as if gathered)."""
    CALLS["forward"] += 1
    BYTES["forward"] += x.numel() * x.element_size()
    if group is LOCAL:
        out = x.new_zeros(parts, *x.shape)
        out[rank] = x
    else:
        flat = x.detach().contiguous().reshape(-1)
        out = flat.new_empty(parts * flat.numel())
        comm.all_gather_flat(out, flat, group=group)
        out = out.view(parts, *x.shape)
    return torch.movedim(out, 0, -2).reshape(*x.shape[:-1], parts * x.shape[-1])


def gather_from_tensor_group(
    x: torch.Tensor, group: ProcessGroup | None, *, rank: int, parts: int
) -> torch.Tensor:
    """All-gather along the last dimension forward (each member's slice of the features,
    in rank order), this member's slice of the gradient backward: a vocabulary-split
    head's whole logits, for a loss that needs them."""
    return _GatherFromTensorGroup.apply(x, group, rank, parts)
