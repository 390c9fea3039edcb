"""Reference models written as layer lists, and a registry to build them by name.

Every model is an ``nn.Sequential`` so that strategies can split it at layer boundaries
(pipeline stages, per-layer sharding) without knowing which model it is; ``loss_for``
gives the matching loss so that the trainer needs nothing but the name.

The builders live in their own modules: ``paratrain.models.mlp.mlp``,
``paratrain.models.lenet.lenet`` and ``paratrain.models.gpt.gpt``. They are deliberately
not re-exported here, because a package attribute named ``mlp`` would shadow the
submodule of the same name.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor, nn

from paratrain.models import gpt as _gpt
from paratrain.models import lenet as _lenet
from paratrain.models import mlp as _mlp
from paratrain.models.gpt import generate, gpt_parameter_count, sequence_cross_entropy

__all__ = [
    "MODEL_NAMES",
    "build_model",
    "count_parameters",
    "generate",
    "gpt_parameter_count",
    "loss_for",
    "sequence_cross_entropy",
]

MODEL_NAMES: tuple[str, ...] = ("mlp", "lenet", "gpt")

_BUILDERS: dict[str, Callable[..., nn.Sequential]] = {
    "mlp": _mlp.mlp,
    "lenet": _lenet.lenet,
    "gpt": _gpt.gpt,
}

_LOSSES: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "mlp": F.cross_entropy,
    "lenet": F.cross_entropy,
    "gpt": sequence_cross_entropy,
}


def _check_name(name: str) -> None:
    if name not in _BUILDERS:
        raise ValueError(f"Unknown model {name!r}; known models are {', '.join(MODEL_NAMES)}.")


def build_model(name: str, **options: object) -> nn.Sequential:
    """Build the model registered as ``name`` with keyword ``options`` (its builder's knobs).

    Options are checked against the builder's signature first, so a typo in a config file
    reads as one sentence naming the option instead of a TypeError from deep inside.
    Call ``torch.manual_seed`` first for identical weights on every rank.
    """
    _check_name(name)
    builder = _BUILDERS[name]
    accepted = sorted(inspect.signature(builder).parameters)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        noun = "option" if len(unknown) == 1 else "options"
        raise ValueError(
            f"Model {name!r} has no {noun} {', '.join(map(repr, unknown))}; "
            f"accepted options are {', '.join(accepted)}."
        )
    return builder(**options)


def loss_for(name: str) -> Callable[[Tensor, Tensor], Tensor]:
    """Loss that trains model ``name``: ``loss(outputs, targets) -> scalar mean``."""
    _check_name(name)
    return _LOSSES[name]


def count_parameters(model: nn.Module) -> int:
    """Number of parameter elements, each shared parameter counted once."""
    return sum(p.numel() for p in model.parameters())
