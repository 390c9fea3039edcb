"""Describing the user's optimizer so a server process can build the same one.

The optimizer is given as a factory (often a lambda), which cannot travel to another
process. So a worker calls the factory once over the whole model, and what travels is the
result's description: the class by import path, its defaults, and each parameter group's
hyperparameters with the names of its parameters. A server rebuilds the class over the
parameters it holds, group by group. JSON only (never a pickle); floats survive JSON
exactly, so the rebuilt optimizer takes the same steps.

One choice is the server's own: where the user left the implementation to torch, the
server builds the fused CPU kernel (see ``paratrain.parallel.fused_optim``); a server
takes one step per push, under its lock, so a slow step is time every worker waits.
"""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from paratrain.parallel.fused_optim import build_fused_where_left_to_torch
from paratrain.parallel.strategy import optimizer_from_factory

_NOT_DESCRIBABLE = (
    "strategy 'ps' rebuilds the optimizer in its server processes from its class and "
    "hyperparameters"
)


def _plain(key: str, value: Any) -> Any:
    """A hyperparameter as JSON, refusing what would not come back the same."""
    if isinstance(value, tuple):
        return {"tuple": [_plain(key, v) for v in value]}
    if isinstance(value, list):
        return [_plain(key, v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    raise ValueError(
        f"{_NOT_DESCRIBABLE}, but hyperparameter {key!r} is {value!r}; pass plain numbers "
        "(not tensors) to the optimizer for strategy 'ps'."
    )


def _restore(value: Any) -> Any:
    if isinstance(value, dict) and "tuple" in value:
        return tuple(_restore(v) for v in value["tuple"])
    if isinstance(value, list):
        return [_restore(v) for v in value]
    return value


def describe_optimizer(
    factory: Callable[[Any], torch.optim.Optimizer], model: nn.Module
) -> dict[str, Any]:
    """Call ``factory`` over ``model``'s parameters and describe the result as JSON."""
    names = {id(p): name for name, p in model.named_parameters()}
    optimizer = optimizer_from_factory(factory, model.named_parameters())
    cls = type(optimizer)
    path = f"{cls.__module__}:{cls.__qualname__}"
    if "<locals>" in cls.__qualname__ or cls.__module__ in ("__main__", "__mp_main__"):
        raise ValueError(
            f"{_NOT_DESCRIBABLE}, but {path} cannot be imported there; define the optimizer "
            "class in an importable module."
        )
    groups = []
    for group in optimizer.param_groups:
        hyper = {k: _plain(k, v) for k, v in group.items() if k != "params"}
        groups.append({"hyper": hyper, "params": [names[id(p)] for p in group["params"]]})
    description = {
        "class": path,
        "defaults": {k: _plain(k, v) for k, v in optimizer.defaults.items()},
        "groups": groups,
    }
    json.dumps(description)  # refuse early what the server could not read
    return description


def build_optimizer(
    description: dict[str, Any], params: dict[str, nn.Parameter]
) -> torch.optim.Optimizer:
    """The described optimizer over the parameters in ``params`` (a server's shard), fused
    where the user left the implementation to torch and torch has a fused CPU kernel."""
    module, _, qualname = description["class"].partition(":")
    cls: Any = importlib.import_module(module)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    groups = []
    for group in description["groups"]:
        mine = [params[name] for name in group["params"] if name in params]
        if mine:
            hyper = {k: _restore(v) for k, v in group["hyper"].items()}
            groups.append({"params": mine, **hyper})
    defaults = {k: _restore(v) for k, v in description["defaults"].items()}
    return build_fused_where_left_to_torch(cls, groups, defaults)
