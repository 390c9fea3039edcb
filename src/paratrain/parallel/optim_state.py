"""Optimizer state keyed by parameter name, so it survives any change of layout.

``torch.optim`` numbers parameters by their position in the optimizer, which differs from
one strategy or device count to another. A checkpoint therefore stores each tensor as
``"<canonical parameter name>/<state key>"`` (``"3.weight/exp_avg"``) and each parameter
group's hyperparameters with the names of its parameters; loading rebuilds the positional
form for whichever optimizer the new layout built.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

IMPLEMENTATION_KEYS = frozenset({"fused", "foreach"})
"""Group settings that pick torch's kernel for the same update, kept by the loader."""


def _json_safe(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _ordered_params(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def named_optimizer_state(
    optimizer: torch.optim.Optimizer, names: dict[int, str]
) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """(tensors by "name/key", groups as {hyperparameters..., "params": [names]})."""
    ordered = _ordered_params(optimizer)
    tensors: dict[str, torch.Tensor] = {}
    for param in ordered:
        for key, value in optimizer.state.get(param, {}).items():
            tensor = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            tensors[f"{names[id(param)]}/{key}"] = tensor.detach().to("cpu")
    groups = [
        {
            **{k: _json_safe(v) for k, v in group.items() if k != "params"},
            "params": [names[id(p)] for p in group["params"]],
        }
        for group in optimizer.param_groups
    ]
    return tensors, groups


def load_named_optimizer_state(
    optimizer: torch.optim.Optimizer,
    names: dict[int, str],
    saved_groups: list[dict[str, Any]],
    state_keys: dict[str, list[str]],
    fetch: Callable[[str], torch.Tensor],
) -> None:
    """Fill ``optimizer`` from a checkpoint: hyperparameters by group, state by name.

    ``state_keys`` maps a parameter name to its saved state keys; ``fetch("name/key")``
    returns a tensor. Each local group takes the hyperparameters of the saved group that
    held its first parameter (an empty one, the saved group at its position), except the
    implementation (``IMPLEMENTATION_KEYS``): which kernel runs is the loading engine's
    choice (dp may have swapped in the fused kernel, and the single-device reference keeps
    the user's), not part of the training state.
    """
    group_of = {name: group for group in saved_groups for name in group["params"]}
    ordered = _ordered_params(optimizer)
    index = {id(p): i for i, p in enumerate(ordered)}
    state: dict[int, dict[str, Any]] = {}
    for param in ordered:
        name = names[id(param)]
        keys = state_keys.get(name, [])
        if keys:
            state[index[id(param)]] = {key: fetch(f"{name}/{key}") for key in keys}
    param_groups = []
    for position, group in enumerate(optimizer.param_groups):
        if group["params"]:
            saved = group_of.get(names[id(group["params"][0])], {})
        elif len(saved_groups) == len(optimizer.param_groups):  # nothing of it here (a
            saved = saved_groups[position]  # ZeRO rank's slice may miss a small group)
        else:
            saved = {}
        merged = {k: v for k, v in group.items() if k != "params"}
        for key, value in saved.items():
            if key != "params" and key in merged and key not in IMPLEMENTATION_KEYS:
                merged[key] = type(merged[key])(value) if isinstance(merged[key], tuple) else value
        merged["params"] = [index[id(p)] for p in group["params"]]
        param_groups.append(merged)
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})
