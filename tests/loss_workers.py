"""Token batches padded unevenly with -100, for the (sum, count) loss tests; spawned
workers import these by name."""

from __future__ import annotations

import torch

from paratrain.losses import token_cross_entropy
from tests import workers

STEPS = 6


def padded_batches(steps: int = STEPS, batch: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """gpt parity batches whose targets end in -100 padding that grows down the batch (0 to
    7 of 8 positions), so that contiguous parts of any split hold different token counts."""
    out = []
    for step, (x, y) in enumerate(workers.parity_batches("gpt", steps, batch)):
        y = y.clone()
        for row in range(batch):
            pad = min(7, row // 2 + step % 2)
            if pad:
                y[row, -pad:] = -100
        out.append((x, y))
    return out


def train(strategy: str, optimizer: str, accumulation: int = 1, **options) -> tuple:
    """The gpt parity model on the padded batches with the (sum, count) token loss."""
    import paratrain

    engine = paratrain.setup(
        workers.parity_model("gpt"),
        optimizer=workers.parity_optimizer(optimizer),
        loss_fn=token_cross_entropy,
        strategy=strategy,
        gradient_accumulation=accumulation,
        **options,
    )
    losses = [engine.train_step(x, y).loss for x, y in padded_batches()]
    x, y = padded_batches()[0]
    losses.append(engine.eval_step(x, y))
    return engine.state_dict(), losses


def train_all(runs: list[tuple]) -> list[tuple]:
    return [
        train(strategy, optimizer, accumulation, **options)
        for strategy, optimizer, accumulation, options in runs
    ]
