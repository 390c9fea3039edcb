"""A plain PyTorch run saved as a distributed checkpoint (DCP), and paratrain engines
continuing it, for tests/test_dcp.py; spawned workers import these by name."""

from __future__ import annotations

import torch

from paratrain.models import build_model

SAVED_STEPS, MORE_STEPS, BATCH = 3, 3, 16
MLP_FLAGS = ["--model", "mlp", "--dataset", "synthetic", "--hidden", "16", "--depth", "1"]
"""The ``ckpt import`` flags of ``mlp()`` (synthetic data: 784 inputs, 10 classes)."""


def mlp(seed: int = 1) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model("mlp", in_features=784, hidden=16, depth=1, classes=10)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [
        (
            torch.randn(BATCH, 784, generator=generator),
            torch.randint(0, 10, (BATCH,), generator=generator),
        )
        for _ in range(SAVED_STEPS + MORE_STEPS)
    ]


def adam(lr: float = 1e-2):
    """torch's per-tensor loop asked for (``foreach=False``): no engine swaps in the fused
    kernel, so the engines run the plain loop's operations."""
    return lambda params: torch.optim.Adam(params, lr=lr, foreach=False)


def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(outputs, targets)


def plain_run(steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The user's loop: ``mlp()`` and Adam over the first ``steps`` batches."""
    model = mlp()
    optimizer = adam()(model.parameters())
    for inputs, targets in batches()[:steps]:
        optimizer.zero_grad()
        loss_fn(model(inputs), targets).backward()
        optimizer.step()
    return model, optimizer


def resume(strategy: str, imported: str, out: str) -> dict[str, torch.Tensor]:
    """Under ``strategy``: a freshly initialised model (another seed, another lr: the
    checkpoint must bring both), the imported checkpoint loaded, the remaining batches,
    then a checkpoint saved at ``out``."""
    import paratrain

    engine = paratrain.setup(
        mlp(seed=7), optimizer=adam(lr=0.5), loss_fn=loss_fn, strategy=strategy
    )
    engine.load_checkpoint(imported)
    for inputs, targets in batches()[SAVED_STEPS:]:
        engine.train_step(inputs, targets)
    engine.save_checkpoint(out)
    return engine.state_dict()
