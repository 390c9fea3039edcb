"""The learning-rate schedules of ``paratrain train`` (``--lr-schedule``, ``--warmup-steps``).

A schedule here is a pure function of the step, applied to the engine's optimizer before
each step (``set_learning_rate``): nothing to save, so a resumed run at any device count
takes the same rate at the same step, and ps servers follow through the optimizer the ps
engine exposes for this. In the Python API any ``torch.optim.lr_scheduler`` on
``engine.optimizer`` works the same way.
"""

from __future__ import annotations

import math

import torch

from paratrain.config import SCHEDULES


def lr_factor(schedule: str, step: int, *, total_steps: int, warmup_steps: int = 0) -> float:
    """The multiple of the base rate for optimizer step ``step`` (1-based): a linear warmup
    from 1/warmup over ``warmup_steps`` steps, then constant, cosine or linear decay to 0
    at ``total_steps``."""
    if schedule not in SCHEDULES:
        raise ValueError(f"lr_schedule must be one of {', '.join(SCHEDULES)}, not {schedule!r}.")
    if warmup_steps and step <= warmup_steps:
        return step / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def set_learning_rate(optimizer: torch.optim.Optimizer, rate: float) -> None:
    """Every parameter group's ``lr`` set to ``rate``."""
    for group in optimizer.param_groups:
        group["lr"] = rate
