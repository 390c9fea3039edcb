"""zero3 units on models that are not layer lists, for tests/test_zero_units.py; spawned
workers import these by name (transformers is imported inside the functions)."""

from __future__ import annotations

import torch
from torch import nn

from tests import hf_workers
from tests.workers import parity_batches, parity_optimizer


class TinyBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class SharedBlocks(nn.Module):
    """Three blocks in a ModuleList, the first and last sharing their ``fc.weight``, and a
    parameter of the model itself (``gate``) used between the blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(12, 16)
        self.blocks = nn.ModuleList(TinyBlock(16) for _ in range(3))
        self.blocks[2].fc.weight = self.blocks[0].fc.weight
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, 16))
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x) * self.gate
        return self.head(x)


def build(kind: str) -> nn.Module:
    if kind == "shared_blocks":
        torch.manual_seed(7)
        return SharedBlocks()
    return hf_workers.build(kind)


def next_token_loss(out, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of each next token (every replica holds as many tokens)."""
    logits = out.logits[:, :-1]
    return nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets[:, 1:].reshape(-1)
    )


def lm_batches() -> list[tuple[dict, torch.Tensor]]:
    """``hf_workers``' right-padded batches, every position a target (no -100 labels:
    zero takes a mean loss, not a token count)."""
    return [(inputs, inputs["input_ids"]) for inputs, _ in hf_workers.batches()]


def train(strategy: str, kind: str, *, save_to: str | None = None, **options) -> dict:
    """SGD-momentum steps under ``strategy``: the state, the losses and the units."""
    import paratrain

    if kind == "shared_blocks":
        batches, loss_fn = parity_batches("mlp", steps=6), nn.functional.cross_entropy
        factory = parity_optimizer("sgd")
    else:
        batches, loss_fn, factory = lm_batches(), next_token_loss, hf_workers.optimizer("sgd")
    engine = paratrain.setup(
        build(kind), optimizer=factory, loss_fn=loss_fn, strategy=strategy, **options
    )
    gathered = watch_gathers(engine, options.get("units")) if strategy == "zero3" else {}
    losses = [engine.train_step(x, y).loss for x, y in batches]
    if save_to is not None:
        engine.save_checkpoint(save_to)
    units = [(unit.label, unit.numel) for unit in getattr(engine, "units", [])]
    return {"state": engine.state_dict(), "losses": losses, "units": units, "gathered": gathered}


def watch_gathers(engine, units) -> dict[str, set[tuple[str, ...]]]:
    """For each unit, the units found gathered whenever one of its modules starts forward
    (the hook runs after the engine's gather hook, registered first)."""
    from paratrain.parallel.zero.units import unit_modules

    seen: dict[str, set[tuple[str, ...]]] = {}
    for label, modules in unit_modules(engine.model, units):
        seen[label] = set()

        def record(_module, _args, label=label) -> None:
            seen[label].add(tuple(unit.label for unit in engine.units if unit.gathered))

        for module in modules:
            module.register_forward_pre_hook(record)
    return seen


def train_all(runs: list[tuple[str, str, str | None, dict]]) -> list[dict]:
    """Every (strategy, kind, save_to, options) in one launch (starting workers is slow)."""
    return [train(strategy, kind, save_to=save, **opts) for strategy, kind, save, opts in runs]
