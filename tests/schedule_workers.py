"""A learning-rate scheduler driving engine.optimizer, for tests/test_lr_schedule.py."""

from __future__ import annotations

import torch

from tests import workers


def train_scheduled(strategy: str, optimizer: str, **options) -> tuple[dict, list[float]]:
    """10 parity steps with a LambdaLR (warmup then decay) stepped after each step, as a
    user writes it against engine.optimizer."""
    engine = workers.parity_engine(strategy, "mlp", optimizer, **options)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        engine.optimizer, lambda step: min(1.0, (step + 1) / 3) * 0.8**step
    )
    losses = []
    for x, y in workers.parity_batches("mlp"):
        losses.append(engine.train_step(x, y).loss)
        schedule.step()
    return engine.state_dict(), losses


def train_all(runs: list[tuple[str, str, dict]]) -> list[tuple[dict, list[float]]]:
    return [train_scheduled(strategy, opt, **options) for strategy, opt, options in runs]
