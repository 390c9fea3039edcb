"""Models whose forward takes several inputs or a dict, and returns a dict, for the tests
of how batches reach forward (``tests/test_inputs.py``); spawned workers import them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

STEPS, BATCH = 4, 8


class TwoInputs(nn.Module):
    """``forward(x, z)``: a tuple batch is passed as two arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(3, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.a(x) + self.b(z)))


class KeywordInputs(nn.Module):
    """``forward(features=..., scale=..., labels=...)`` returning a dict with its own loss,
    as Hugging Face models do; ``scale`` is a plain value every share receives."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(6, 8), nn.Linear(8, 4)

    def forward(self, features, scale: float = 1.0, labels=None) -> dict:
        logits = self.head(torch.relu(self.body(features))) * scale
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


class ToDict(nn.Module):
    """A layer returning a dict: the pipeline must carry it to the next stage."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 8)

    def forward(self, x: torch.Tensor) -> dict:
        return {"hidden": self.proj(x), "ids": (x > 0).long().sum(-1), "tag": "kept"}


class FromDict(nn.Module):
    """Takes the dict, returns a tuple (a float tensor needing gradients, an int tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, value: dict) -> tuple:
        assert value["tag"] == "kept"
        return torch.tanh(self.proj(value["hidden"])) + value["ids"].unsqueeze(-1), value["ids"]


class FromTuple(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 4)

    def forward(self, value: tuple) -> torch.Tensor:
        hidden, ids = value
        return self.head(hidden) + 0 * ids.unsqueeze(-1)


def build(kind: str) -> nn.Module:
    torch.manual_seed(7)
    if kind == "two_inputs":
        return TwoInputs()
    if kind == "keywords":
        return KeywordInputs()
    return nn.Sequential(ToDict(), FromDict(), FromTuple())  # "structured" (pipeline)


def batches(kind: str) -> list[tuple]:
    generator = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        x = torch.randn(BATCH, 6, generator=generator)
        y = torch.randint(0, 4, (BATCH,), generator=generator)
        if kind == "two_inputs":
            out.append(((x, torch.randn(BATCH, 3, generator=generator)), y))
        elif kind == "keywords":
            out.append(({"features": x, "scale": 0.5, "labels": y}, None))
        else:
            out.append((x, y))
    return out


def loss_for(kind: str):
    if kind == "keywords":
        return lambda outputs, _: outputs["loss"]
    return F.cross_entropy


def train(strategy: str, kind: str, **options) -> tuple[dict, list[float]]:
    import paratrain

    engine = paratrain.setup(
        build(kind),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        loss_fn=loss_for(kind),
        strategy=strategy,
        **options,
    )
    losses = [engine.train_step(x, y).loss for x, y in batches(kind)]
    x, y = batches(kind)[0]
    losses.append(engine.eval_step(x, y))
    return engine.state_dict(), losses


def train_all(runs: list[tuple[str, str, dict]]) -> list[tuple[dict, list[float]]]:
    """Every (strategy, kind, options) in one launch."""
    return [train(strategy, kind, **options) for strategy, kind, options in runs]
