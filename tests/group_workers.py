"""AdamW with weight decay on matrices only, grouped by name, for tests/test_param_groups.py."""

from __future__ import annotations

import torch

from tests import workers


def grouped_adamw(named_parameters):
    """The standard recipe: decay on weights of 2 or more dimensions, none on biases and
    norms; a factory whose first parameter is named ``named_parameters`` gets the pairs."""
    decay = [p for name, p in named_parameters if p.dim() >= 2 and not name.endswith("bias")]
    no_decay = [p for name, p in named_parameters if p.dim() < 2 or name.endswith("bias")]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.5}, {"params": no_decay, "weight_decay": 0.0}],
        lr=0.01,
    )


def train(strategy: str, **options) -> tuple[dict, list[float]]:
    import paratrain
    from paratrain.models import loss_for

    engine = paratrain.setup(
        workers.parity_model("gpt"),
        optimizer=grouped_adamw,
        loss_fn=loss_for("gpt"),
        strategy=strategy,
        **options,
    )
    losses = [engine.train_step(x, y).loss for x, y in workers.parity_batches("gpt")]
    return engine.state_dict(), losses


def train_all(runs: list[tuple[str, dict]]) -> list[tuple[dict, list[float]]]:
    return [train(strategy, **options) for strategy, options in runs]
