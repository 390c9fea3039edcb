"""Fused CPU optimizer kernels, where the user left the implementation to torch.

Why: on CPU, torch's default implementation of SGD, Adam, AdamW and Adagrad is the
per-tensor Python loop; the fused kernel (torch >= 2.4) updates every tensor in one call.
On the quick-start gpt an Adam step takes 4 ms looped against 1 ms fused, which is time
every data-parallel step pays and a parameter server pays per push, under its lock.
DeepSpeed makes the same choice with its FusedAdam. The update is the same function (its
results agree to float rounding; the parity tests hold at 1e-5), and a user who names an
implementation (``fused=...``, ``foreach=...``) gets exactly what they named.

Only for exactly these classes (a subclass may override ``step``), only where every
parameter lives on the CPU (CUDA defaults are already vectorized), and only on an optimizer
that has not stepped yet (engines apply it to what the user's factory just returned).
The single-device engine keeps the user's optimizer as built: it is the reference that the
parity tests hold every other engine to. A rebuilt optimizer is a new object, so code that
needs it (a learning-rate scheduler) takes ``engine.optimizer``, not what the factory made.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

FUSED_ON_CPU = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad)


def implementation_left_to_torch(hyper: dict[str, Any]) -> bool:
    """Whether a group's (or the defaults') settings leave the kernel choice to torch."""
    return (
        hyper.get("fused") is None
        and hyper.get("foreach") is None
        and not hyper.get("differentiable", False)
    )


def fuse_where_left_to_torch(
    cls: type, defaults: dict[str, Any], groups: Sequence[dict[str, Any]]
) -> bool:
    """Set ``fused=True`` in ``defaults`` and every group where the rules above allow it;
    returns whether it did. ``groups`` hold their ``params``."""
    params = [p for group in groups for p in group["params"]]
    fuse = (
        cls in FUSED_ON_CPU
        and all(p.device.type == "cpu" for p in params)
        and all(implementation_left_to_torch(h) for h in [defaults, *groups])
    )
    if fuse:
        defaults["fused"] = True
        for group in groups:
            group["fused"] = True
    return fuse


def construct(cls: type, groups: list[dict[str, Any]], defaults: dict[str, Any]):
    """``cls(groups, **defaults)``, passing only the defaults its constructor takes (a
    subclass may fix one, as AdamW fixes ``decoupled_weight_decay``; every group carries
    each value anyway)."""
    accepted = inspect.signature(cls.__init__).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        defaults = {k: v for k, v in defaults.items() if k in accepted}
    return cls(groups, **defaults)


def with_fused_kernel(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The same optimizer rebuilt with the fused CPU kernel where allowed, else itself."""
    if any(float(state.get("step", 1)) != 0 for state in optimizer.state.values()):
        return optimizer  # it stepped (Adagrad fills its state at step 0, in __init__)
    cls = type(optimizer)
    defaults = dict(optimizer.defaults)
    groups = [dict(group) for group in optimizer.param_groups]
    if not fuse_where_left_to_torch(cls, defaults, groups):
        return optimizer
    return construct(cls, groups, defaults)
