"""Gradient clipping by the global norm, as ``torch.nn.utils.clip_grad_norm_`` on one device.

The norm is over the whole model's gradient, whichever worker holds which part of it:
replicas hold equal copies (dp: the local norm is the global one), ZeRO ranks hold slices
(their squared norms add up over the replicas), pipeline stages hold their layers (squared
norms add up over the stages of a replica; a weight tied across stages counts once), ps
servers hold shards of a round's mean gradient (their squared norms add up over the
servers: ``ps/clipping.py``). Every worker then multiplies its gradients by
``min(1, max_norm / (norm + 1e-6))``, the factor torch uses, and ``StepStats.grad_norm``
reports the norm before clipping.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed import ProcessGroup

from paratrain.runtime import comm


def _positive(value: float) -> float:
    if not value > 0:
        raise ValueError(f"max_grad_norm must be positive, not {value!r}.")
    return float(value)


def check_max_grad_norm(value: float | None) -> float | None:
    """None (no clipping) or a positive float; anything else refused with a sentence."""
    return None if value is None else _positive(value)


def squared_norm(grads: Iterable[torch.Tensor], *, device: torch.device) -> torch.Tensor:
    """The sum of the squares of every entry of ``grads``, in float64 (a 0-dim tensor on
    ``device``): parts of one gradient held in different places add up to its square
    norm, with float64 keeping the order of the addition out of the float32 result."""
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for grad in grads:
        squares += torch.linalg.vector_norm(grad.double()) ** 2
    return squares


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(1, max_norm / (total_norm + 1e-6))``, as ``clip_grad_norm_`` computes it (the
    1e-6 and the clamp are torch's)."""
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)


def clip_local(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Every gradient is here (one device, or a replica after the all-reduce): torch's own.
    The norm stays a tensor on the device: reading it waits for the device, so a step reads
    it only once the optimizer's work is queued (on a GPU a read here idled it ~1 ms a step
    while the optimizer's launches ran on the host)."""
    grads = [p for p in parameters if p.grad is not None]
    return torch.nn.utils.clip_grad_norm_(grads, max_norm)


def clip_distributed(
    grads: list[torch.Tensor],
    max_norm: float,
    *,
    device: torch.device,
    group: ProcessGroup | None = None,
    copies: int = 1,
    duplicates: list[torch.Tensor] | None = None,
    shared: list[torch.Tensor] | None = None,
    shared_by: int = 1,
) -> float:
    """This worker holds ``grads``, a part of the gradient: the squared norms are summed
    over ``group`` (every worker of it must call), where each part is held ``copies``
    times (pipeline replicas); returns the global norm, the gradients clipped in place.
    ``duplicates`` (second copies of a tied weight) are clipped by the same factor, to the
    bit, without counting in the norm. ``shared`` are parts that ``shared_by`` workers of
    the group hold alike on top of that (the replicated tensors of a tensor group, whose
    split slices are in ``grads``): each counts once."""
    squares = squared_norm(grads, device=device).reshape(1)
    if shared:
        squares += squared_norm(shared, device=device) / shared_by
    if comm.distributed():
        comm.all_reduce_sum(squares, group=group)
    total = torch.sqrt(squares[0] / copies).float()
    coefficient = clip_coefficient(total, max_norm)
    scaled = [*grads, *(shared or []), *(duplicates or [])]
    if scaled:
        torch._foreach_mul_(scaled, coefficient.to(scaled[0].device))
    return float(total)
