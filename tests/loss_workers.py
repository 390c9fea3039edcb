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


def optimizer_factory(name: str):
    """The parity optimizers with torch's plain per-tensor loop asked for explicitly
    (``foreach=False``), so that no engine swaps in the fused kernel: on these padded
    batches Adam turns the fused kernel's last-bit differences (tests/test_fused_optim.py
    holds them to 1e-6 a step) into more than the 1e-5 this file tests engines by."""
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=False)
    return lambda params: torch.optim.Adam(params, lr=0.01, foreach=False)


def train(strategy: str, optimizer: str, accumulation: int = 1, **options) -> tuple:
    """The gpt parity model on the padded batches with the (sum, count) token loss."""
    import paratrain

    engine = paratrain.setup(
        workers.parity_model("gpt"),
        optimizer=optimizer_factory(optimizer),
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
