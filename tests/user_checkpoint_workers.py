"""Worker side of ``test_user_checkpoint``: layers that checkpoint their own insides."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from tests import workers


class CheckpointedBlock(torch.nn.Module):
    """A residual block whose two Linears run inside ``torch.utils.checkpoint`` (as a
    Hugging Face model's layers do after ``gradient_checkpointing_enable()``); ``reentrant``
    None runs them plainly (the reference)."""

    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.up = torch.nn.Linear(24, 24)
        self.down = torch.nn.Linear(24, 24)
        self.reentrant = reentrant

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reentrant is None:
            return x + self.inner(x)
        return x + checkpoint(self.inner, x, use_reentrant=self.reentrant)


def checkpointed_layers(reentrant: bool | None) -> torch.nn.Sequential:
    """A layer list: a Linear in, three checkpointed blocks, a head; the same weights
    whatever ``reentrant``."""
    torch.manual_seed(1234)
    blocks = [CheckpointedBlock(reentrant) for _ in range(3)]
    return torch.nn.Sequential(torch.nn.Linear(12, 24), *blocks, torch.nn.Linear(24, 5))


def checkpointed_worker(runs: list[tuple[bool, str, dict]]) -> list[dict]:
    """Each (use_reentrant, optimizer, engine options) trained 10 steps; final states."""
    import paratrain
    from paratrain.models import loss_for

    states = []
    for reentrant, optimizer, options in runs:
        engine = paratrain.setup(
            checkpointed_layers(reentrant),
            optimizer=workers.parity_optimizer(optimizer),
            loss_fn=loss_for("mlp"),
            **options,
        )
        for x, y in workers.parity_batches("mlp"):
            engine.train_step(x, y)
        states.append(engine.state_dict())
    return states
