"""Fused CPU optimizer kernels, where the user left the implementation to torch.

Why: on CPU, torch's default implementation of SGD, Adam, AdamW and Adagrad is the
per-tensor Python loop; the fused kernel (torch >= 2.4) updates every tensor in one call.
On the quick-start gpt an Adam step takes 4 ms looped against 1 ms fused, which is time
every data-parallel step pays and a parameter server pays per push, under its lock.
DeepSpeed makes the same choice with its FusedAdam. A user who names an implementation
(``fused=...``, ``foreach=...``) gets exactly what they named.

The swap must never change what the user's optimizer does, so it is made only where the
fused kernel computes the default's update (to float rounding; the parity tests hold at
1e-5), and each step falls back to the default where it would not. Measured against the
default on torch 2.13 (``tests/test_fused_optim.py``), the fused CPU kernels:

- fail where the default works: SGD with momentum when some parameters that have a
  gradient already hold a momentum buffer and others do not yet (a parameter's first
  gradient comes after the others' first step: ``TypeError: expected Tensor as element
  ...``); sparse gradients (SGD, Adagrad); complex parameters;
- compute something else: float16/bfloat16 parameters (the fused kernel updates in fp32
  and rounds once; the default rounds each operation: 1e-4 to 4e-3 apart after three
  steps); a gradient whose strides differ from its parameter's (a contiguous gradient of
  a channels-last or transposed parameter: the kernel pairs elements by memory order,
  1-10% wrong, silently);
- agree everywhere else we tried: parameters that skip steps or get their first gradient
  late (Adam, AdamW, Adagrad keep a step count per parameter), amsgrad, nesterov,
  dampening, weight decay, maximize, tensor learning rates, float64.

So the swap is made only for these exact classes (a subclass may override ``step``),
only where every parameter is a float32 or float64 CPU tensor, only on an optimizer that
has not stepped yet (engines apply it to what the user's factory just returned), and a
step pre-hook runs a group on the default implementation for any step in which one of
its gradients is sparse or strided unlike its parameter, or, for SGD with momentum, its
parameters with gradients mix held and missing buffers. Both implementations keep the
same state (``momentum_buffer``; ``step`` as a float32 CPU tensor, ``exp_avg``...), so a
step on either continues the other exactly. The single-device engine keeps the user's
optimizer as built: it is the reference that the parity tests hold every other engine
to. A rebuilt optimizer is a new object, so code that needs it (a learning-rate
scheduler) takes ``engine.optimizer``, not what the factory made.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

FUSED_ON_CPU = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad)
_SAME_UPDATE_DTYPES = (torch.float32, torch.float64)
"""Parameter dtypes for which the fused CPU kernel computes the default's update."""


def implementation_left_to_torch(hyper: dict[str, Any]) -> bool:
    """Whether a group's (or the defaults') settings leave the kernel choice to torch."""
    return (
        hyper.get("fused") is None
        and hyper.get("foreach") is None
        and not hyper.get("differentiable", False)
    )


def fusable(cls: type, defaults: dict[str, Any], groups: Sequence[dict[str, Any]]) -> bool:
    """Whether the rules above allow the fused kernel; ``groups`` hold their ``params``."""
    params = [p for group in groups for p in group["params"]]
    return (
        cls in FUSED_ON_CPU
        and all(p.device.type == "cpu" and p.dtype in _SAME_UPDATE_DTYPES for p in params)
        and all(implementation_left_to_torch(h) for h in [defaults, *groups])
    )


def fuse_where_left_to_torch(
    cls: type, defaults: dict[str, Any], groups: Sequence[dict[str, Any]]
) -> bool:
    """Set ``fused=True`` in ``defaults`` and every group where the rules above allow it;
    returns whether it did. ``groups`` hold their ``params``."""
    fuse = fusable(cls, defaults, groups)
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


def build_fused_where_left_to_torch(
    cls: type, groups: list[dict[str, Any]], defaults: dict[str, Any]
) -> torch.optim.Optimizer:
    """``cls(groups, **defaults)``, on the fused kernel where the rules above allow it,
    with the per-step fallback to the default implementation installed."""
    fused = fuse_where_left_to_torch(cls, defaults, groups)
    optimizer = construct(cls, groups, defaults)
    if fused:
        optimizer.register_step_pre_hook(_default_where_fused_differs)
        optimizer.register_step_post_hook(_fused_again)
    return optimizer


def with_fused_kernel(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The same optimizer rebuilt with the fused CPU kernel where allowed, else itself."""
    if any(float(state.get("step", 1)) != 0 for state in optimizer.state.values()):
        return optimizer  # it stepped (Adagrad fills its state at step 0, in __init__)
    cls = type(optimizer)
    defaults = dict(optimizer.defaults)
    groups = [dict(group) for group in optimizer.param_groups]
    if not fusable(cls, defaults, groups):
        return optimizer
    return build_fused_where_left_to_torch(cls, groups, defaults)


def fused_kernel_agrees(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    """Whether this step of ``group`` on the fused kernel computes the default's update
    (see the module's docstring for what was measured)."""
    check_buffers = type(optimizer) is torch.optim.SGD and group.get("momentum", 0) != 0
    buffers = set()
    for param in group["params"]:
        grad = param.grad
        if grad is None:
            continue
        if grad.is_sparse or grad.stride() != param.stride():
            return False
        if check_buffers:
            state = optimizer.state.get(param)
            buffers.add(state is not None and state.get("momentum_buffer") is not None)
    return len(buffers) < 2


def _default_where_fused_differs(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    for group in optimizer.param_groups:
        group["fused"] = fused_kernel_agrees(optimizer, group)


def _fused_again(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    for group in optimizer.param_groups:
        group["fused"] = True
