"""The user's parameter groups, carried over to the flat slices a ZeRO rank optimizes.

The factory builds its groups from the model's parameters (by name when its first
parameter is called ``named_parameters``: no weight decay on biases and norms), but a
ZeRO rank's optimizer holds flat slices. So the factory is first called on stand-ins of
the model's parameters (meta tensors of the same names, shapes and dtypes, which cost no
memory; the real parameters where the factory refuses meta tensors, as ``fused=True``
does) to learn which parameter goes in which group with which hyperparameters
(``ParamGroups``). The engine then lays out its flat units so that no slice it hands the
optimizer mixes two groups, and ``ParamGroups.build`` makes an optimizer of the same class
with the same groups over those slices. An elementwise optimizer (``optim``) then updates
each element with its own parameter's group settings: exactly the plain loop.

When the factory takes plain parameters and builds one group over all of them, it is
called on the slices themselves, as before, so the optimizer is the very object it builds.
A factory that ignores what it is given and reads the model itself (nanoGPT's
``lambda params: model.configure_optimizers(...)``) is matched by tensor identity, as dp
matches it, and its groups rebuilt over the slices like any other.

Refused, with a sentence: a trainable parameter the factory leaves out (it would train
under the plain loop never, here it would need a slice of its own that nothing updates),
a parameter listed twice (the plain loop would update it twice), and a tensor that is
neither one of the model's parameters nor a stand-in it was given.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paratrain.parallel.strategy import OptimizerFactory, optimizer_from_factory, wants_names


@dataclass
class ParamGroups:
    """What the user's factory built: its class, its keyword defaults and, per group, the
    hyperparameters and the names of the trainable parameters it holds."""

    kind: type[torch.optim.Optimizer]
    defaults: dict[str, Any]
    settings: list[dict[str, Any]]
    names: list[list[str]]
    plain: bool
    """The factory takes plain parameters and built one group: call it on the slices."""

    def index(self) -> dict[str, int]:
        """Parameter name -> group index."""
        return {name: i for i, names in enumerate(self.names) for name in names}

    def build(
        self, factory: OptimizerFactory, tensors: Sequence[Sequence[nn.Parameter]]
    ) -> torch.optim.Optimizer:
        """The optimizer over ``tensors`` (one list per group, in group order)."""
        if self.plain:
            return factory([t for group in tensors for t in group])
        groups = [
            {**settings, "params": list(group)}
            for settings, group in zip(self.settings, tensors, strict=True)
        ]
        accepted = inspect.signature(self.kind.__init__).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
            keywords = dict(self.defaults)
        else:
            keywords = {k: v for k, v in self.defaults.items() if k in accepted}
        return self.kind(groups, **keywords)


def learn_groups(
    factory: OptimizerFactory, named: list[tuple[str, nn.Parameter]], *, strategy: str
) -> ParamGroups:
    """Call ``factory`` on stand-ins of ``named`` (every parameter, frozen ones too, as dp
    passes them) and read its groups; refuse what flat slices cannot reproduce."""
    stand_ins = [
        (name, nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad))
        for name, p in named
    ]
    try:
        optimizer = optimizer_from_factory(factory, stand_ins)
    except Exception:  # a factory that needs real tensors (fused=True checks the device)
        stand_ins = list(named)
        optimizer = optimizer_from_factory(factory, stand_ins)
    name_of = {id(p): name for name, p in stand_ins}
    given = set(name_of)
    # a factory that reads the model itself (nanoGPT's ``configure_optimizers``, groups
    # built from ``model.named_parameters()``): its tensors are matched by identity, as dp
    name_of.update({id(p): name for name, p in named})
    trainable = {name for name, p in named if p.requires_grad}
    seen: set[str] = set()
    names: list[list[str]] = []
    for group in optimizer.param_groups:
        held = []
        for param in group["params"]:
            name = name_of.get(id(param))
            if name is None:
                raise ValueError(
                    f"{strategy} maps the optimizer's parameter groups onto the model's "
                    "parameters, and the factory put a tensor in it that is neither one of "
                    "them nor one it was given; build the optimizer from the model's "
                    "parameters, or from the (name, parameter) pairs a factory whose first "
                    "argument is called named_parameters is given."
                )
            if name in seen:
                raise ValueError(
                    f"the optimizer factory lists parameter {name!r} twice, which {strategy} "
                    "cannot reproduce on flat slices (each element is updated once); list "
                    "each parameter in one group once, or use strategy='dp'."
                )
            seen.add(name)
            if name in trainable:
                held.append(name)
        names.append(held)
    left_out = sorted(trainable - seen)
    if left_out:
        raise ValueError(
            f"the optimizer factory leaves out trainable parameter(s) {left_out[:3]}, and "
            f"{strategy} hands every trainable parameter to the optimizer in flat slices; "
            "give them to the optimizer, set requires_grad=False on them, or use strategy='dp'."
        )
    settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    # called on the slices again only if it built its optimizer from what it was given
    took_given = all(id(p) in given for group in optimizer.param_groups for p in group["params"])
    plain = not wants_names(factory) and len(names) == 1 and took_given
    return ParamGroups(type(optimizer), dict(optimizer.defaults), settings, names, plain)
