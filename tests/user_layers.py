"""Models of the kinds users write that the pipeline must see through
(``workers.parity_model`` builds them by name): layer lists whose weights and values the
zero-bubble W's unit proof must follow, and a model cut at named blocks whose first block
holds no state (``wrapped``, the ``Wrapped`` class below).

- ``weight_norm``: two Linears under ``torch.nn.utils.parametrizations.weight_norm``: the
  weight a module uses is computed in its forward from two parameters that a submodule
  (the parametrization) owns.
- ``symmetric``: the same with a user's own parametrization (a symmetric weight from its
  upper triangle).
- ``inplace``: residual blocks that change values in place: a ReLU(inplace=True) on a
  Linear's output, that output scaled in place by a parameter of the block (outside the
  Linear), the residual added in place.
"""

from __future__ import annotations

import torch
from torch.nn.utils import parametrizations, parametrize

KINDS = ("weight_norm", "symmetric", "inplace")


class Symmetric(torch.nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.triu() + weight.triu(1).transpose(-1, -2)


class InPlaceBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(24, 24)
        self.down = torch.nn.Linear(24, 24)
        self.act = torch.nn.ReLU(inplace=True)
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 24))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.down(self.act(self.up(x)))
        hidden.mul_(self.scale)
        out = x.clone()
        out += hidden
        return out


class Wrapped(torch.nn.Module):
    """The parity mlp (Flatten, Linear, ReLU, ...) inside a model that is no layer list:
    the pipeline cuts it at named blocks of ``body``, and a cut at ``body.1`` leaves the
    first stage a Flatten alone, no state of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Flatten(),
            torch.nn.Linear(12, 24),
            torch.nn.ReLU(),
            torch.nn.Linear(24, 24),
            torch.nn.ReLU(),
            torch.nn.Linear(24, 5),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def build(kind: str) -> torch.nn.Module:
    """The model ``kind`` (one of ``KINDS``, or ``wrapped``), identical from the seed."""
    torch.manual_seed(1234)
    if kind == "wrapped":
        return Wrapped()
    if kind == "inplace":
        blocks = [InPlaceBlock() for _ in range(3)]
        return torch.nn.Sequential(torch.nn.Linear(12, 24), *blocks, torch.nn.Linear(24, 5))
    layers: list[torch.nn.Module] = [torch.nn.Linear(12, 24), torch.nn.ReLU()]
    for _ in range(2):
        layers += [torch.nn.Linear(24, 24), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(24, 5))
    for index in (2, 4):  # both behind the first stage, fed data
        if kind == "weight_norm":
            parametrizations.weight_norm(model[index])
        else:
            parametrize.register_parametrization(model[index], "weight", Symmetric())
    return model


def pipeline_worker(runs: list[tuple[str, str, dict]]) -> list[tuple[dict, list[int]]]:
    """Each (kind, optimizer, pipeline options) trained 10 steps: the final state, and the
    chunks whose W was ever taken whole (their graph failed the unit proof)."""
    from tests import workers

    out = []
    for kind, optimizer, options in runs:
        engine = workers.parity_engine("pipeline", kind, optimizer, **options)
        for x, y in workers.parity_batches(kind):
            engine.train_step(x, y)
        out.append((engine.state_dict(), sorted(engine.stage_parts.cut_chunks)))
    return out
