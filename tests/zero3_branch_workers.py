"""A model whose replicas run different zero3 units in the same step, for
tests/test_zero3_branches.py (spawned workers import these by name)."""

from __future__ import annotations

import torch
from torch import nn

STEPS, BATCH = 3, 8


class Branches(nn.Module):
    """Five zero3 units (top-level children): ``branch`` in the middle runs only where some
    sample's feature 0 is positive, ``tail`` (last in module order, called last) only
    where feature 1 is. Each branch is masked per sample, so a sample's output does not
    depend on the others in its batch: the single-device loop and any split compute the
    same function."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(12, 12)
        self.branch = nn.Linear(12, 12)
        self.body = nn.Linear(12, 24)
        self.head = nn.Linear(24, 5)
        self.tail = nn.Linear(24, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.first(x))
        taken = x[:, 0] > 0
        if bool(taken.any()):
            h = h + taken.unsqueeze(1) * self.branch(h)
        hidden = torch.relu(self.body(h))
        out = self.head(hidden)
        late = x[:, 1] > 0
        if bool(late.any()):
            out = out + late.unsqueeze(1) * self.tail(hidden)
        return out


class Gated(nn.Module):
    """``main(h)``, plus ``branch(h)`` on the rows ``taken`` marks (where there are any)."""

    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Linear(12, 12)
        self.branch = nn.Linear(12, 12)

    def forward(self, h: torch.Tensor, taken: torch.Tensor) -> torch.Tensor:
        g = self.main(h)
        if bool(taken.any()):
            g = g + taken.unsqueeze(1) * self.branch(h)
        return g


class GatedMiddle(nn.Module):
    """Five zero3 units; the third (``gated``) holds ``main``, which every sample uses, and
    ``branch``, which only samples with a positive feature 0 use, so a replica whose share
    has none leaves that parameter out of a unit it still runs, in the middle of the
    model. Backward reaches two more units after it: a replica that used the branch
    reduces ``pre`` after ``gated`` (waiting for ``gated``'s reduction, at most one in
    flight) before it gathers ``first``, which the other replica needs to go on."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(12, 12)
        self.pre = nn.Linear(12, 12)
        self.gated = Gated()
        self.body = nn.Linear(12, 24)
        self.head = nn.Linear(24, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.pre(torch.relu(self.first(x))))
        g = self.gated(h, x[:, 0] > 0)
        return self.head(torch.relu(self.body(torch.relu(g))))


FIRST, SECOND = tuple(range(BATCH // 2)), tuple(range(BATCH // 2, BATCH))
TAKEN = [  # per step, (feature 0, feature 1): the samples (of 8) where it is positive
    (FIRST, FIRST),
    (SECOND, FIRST),
    ((0, 7), (3, 4)),
]
"""At 2 replicas (samples 0-3 and 4-7): each branch runs on one replica only, the other
one the next step, then on both; at 4 replicas (two samples each) on some of them."""


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    out = []
    for step in range(STEPS):
        x = torch.randn(BATCH, 12, generator=generator)
        x[:, :2] = -x[:, :2].abs() - 0.1
        for feature, samples in enumerate(TAKEN[step]):
            x[list(samples), feature] *= -1
        out.append((x, torch.randint(0, 5, (BATCH,), generator=generator)))
    return out


def build(kind: str = "branches") -> nn.Module:
    torch.manual_seed(3)
    return Branches() if kind == "branches" else GatedMiddle()


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def steps() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The batches, then the second once more (after an evaluation in ``train``)."""
    return [*batches(), batches()[1]]


def plain_loop(kind: str = "branches") -> dict:
    model = build(kind)
    opt = optimizer(model.parameters())
    for x, y in steps():
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(strategy: str, kind: str = "branches") -> dict:
    import paratrain

    engine = paratrain.setup(
        build(kind), optimizer=optimizer, loss_fn=nn.functional.cross_entropy, strategy=strategy
    )
    for step, (x, y) in enumerate(steps()):
        if step == STEPS:  # an evaluation (no backward) where replicas differ, in between
            engine.eval_step(*batches()[0])
        engine.train_step(x, y)
    return engine.state_dict()
