"""Staleness-aware learning rate: a stale push moves the parameters less.

Why: a gradient computed on parameters that are ``tau`` updates old points where the
parameters were, not where they are. Applied at full learning rate, each of the ``tau``
updates in between has already moved the parameters along much the same direction, so
the stale push overshoots; asynchrony acts like extra momentum (Mitliagkas et al., 2016,
"Asynchrony begets momentum"), which on top of Adam's own momentum costs a lot. Measured on
the quick-start gpt (``benchmarks/stale_adam.py`` and ``benchmarks/bench_ps.py``), pushes
two or three versions stale at Adam's ``lr=1e-3`` end far above the synchronous loss.

The remedy of Zhang et al. (2016, "Staleness-aware async-SGD for distributed deep
learning") is to divide the learning rate of each push by its staleness. Here the
staleness of a push counts the updates applied between its pull and its arrival, so a
push with staleness 1 is already one update behind, and the rate is divided by
``staleness + 1``: the ``tau + 1`` pushes computed on one version share that version's
step. The difference is largest under a staleness bound, where workers released together
push gradients of the same parameters one after the other: dividing by ``max(1, tau)``
applied the first two at the full rate, and a simulation of that pattern on the
quick-start gpt ended at 2.95 against 2.62 (``bench_ps.py``'s ps-staleness2 measured the
same, 2.95 and 2.61). A fresh push (staleness 0) keeps the user's rate, so ``staleness=0``
(synchronous) runs are unchanged, and the rate is restored after every step, so schedules
and checkpoints see the user's value.

Policies: ``"inverse"`` (the default: lr / (staleness + 1)) and ``"constant"`` (every
push at the user's learning rate, the classic Downpour behaviour).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

POLICIES = ("inverse", "constant")


def check_policy(policy: object) -> str:
    """Refuse a staleness_lr policy that is not one of :data:`POLICIES`."""
    if policy not in POLICIES:
        raise ValueError(
            f"staleness_lr must be one of {', '.join(repr(p) for p in POLICIES)}, not {policy!r}."
        )
    return str(policy)


def lr_factor(policy: str, staleness: int) -> float:
    """The factor on the learning rate of a push that is ``staleness`` versions old."""
    if policy == "constant":
        return 1.0
    return 1.0 / (1 + max(0, staleness))


@contextmanager
def scaled_learning_rate(optimizer: torch.optim.Optimizer, factor: float) -> Iterator[None]:
    """Every group's ``lr`` times ``factor`` inside the block, the user's value after."""
    if factor == 1.0:
        yield
        return
    saved = [group["lr"] for group in optimizer.param_groups]
    for group, lr in zip(optimizer.param_groups, saved, strict=True):
        group["lr"] = lr * factor
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, saved, strict=True):
            group["lr"] = lr
