"""A plain ``nn.Linear``'s W computed directly: ``grad_out^T @ x`` and the bias's row sum.

Why: a unit's W through autograd (``weight_units.Unit.backward_weight``) is a call of the
engine per module, which for a Linear runs its ``addmm`` backward for the weight alone,
transposes the result back and, where ``.grad`` is empty, copies it into the weight's
layout. Measured on the last stage of the bench's 2-stage gpt (17 Linear units among 26,
one thread, CPU time): W 11.97 ms a micro-batch with every unit through autograd, 11.09
with the Linear ones direct; on its mlp 4.15 against 3.72 (docs/benchmarks.md).

Exact: the same products of the same tensors as autograd's W of that unit. The weight's
gradient is the one ``mm`` that ``addmm``'s backward makes for it (``grad_out^T`` times
the input's rows; equal bit for bit on contiguous 2-D and 3-D inputs,
``test_linear_weight``) and the bias's the same sum over rows; each goes into ``.grad``
as autograd's accumulation does where it is empty. Where ``.grad`` already holds a
gradient (every micro-batch of a step but the first), the weight's product is added
inside the matrix product (``addmm_``), not after it: autograd's accumulation reads and
writes the whole weight-sized gradient once more, 0.34 ms of a W's 0.89 for a 1024 x 1024
weight of 32 rows here (the product alone 0.54 ms, accumulated inside it 0.55). The same
products and sums, the held gradient added in the kernel's order: bit for bit equal at
up to 32 rows on this machine's kernels, within one rounding (8e-8 relative) at 512;
the parity tolerance holds it. The bias's row sum is added in place.
Taken only where nothing else could act between the module and its gradients: the module
is exactly ``nn.Linear`` with its class's forward (no subclass or forward set on the
instance, which may compute otherwise; no parametrization, which makes a subclass), it
was called with its input alone, no hook but the round's own is on it and none on every
module (torch's global module hooks), the input, output and weight share one dtype
(under autocast they do not: the product ran on cast copies), and at W time no hook is
on its parameters (a replica's gradient buckets and ZeRO count gradients by such hooks,
which only autograd runs) and neither the input nor the output was changed in place
since the call (``y = linear(x); y.mul_(2)`` leaves the gradient B found at ``y`` one
that autograd's W carries back through the ``mul_``, and a changed input is one autograd
refuses). Any other unit keeps autograd's W.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.modules.module as module_hooks
from torch import nn

_GLOBAL_HOOKS = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
)
"""torch's hooks on every module (``register_module_forward_hook`` and its kin)."""


def _hooked(module: nn.Module) -> bool:
    """Whether some hook besides the round's one forward hook (``UnitHooks``) could see
    or change this module's call or its gradients."""
    if any(getattr(module_hooks, name, None) for name in _GLOBAL_HOOKS):
        return True
    return bool(
        len(module._forward_hooks) != 1
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
    )


@dataclass
class LinearCall:
    """One call of a plain Linear whose W may be taken directly: its input and output and
    the versions they had when it returned (an in-place change of either since leaves
    autograd's W the only exact one)."""

    x: torch.Tensor
    out: torch.Tensor
    versions: tuple[int, int]
    """``x``'s and ``out``'s versions when the call returned (the round's hook reads them
    then)."""

    def unchanged(self) -> bool:
        return (self.x._version, self.out._version) == self.versions


def linear_call(
    module: nn.Module,
    args: tuple,
    outputs: list[torch.Tensor],
    versions: tuple[int, int],
) -> LinearCall | None:
    """This call of ``module`` if its W may be taken directly (see the module docstring),
    else None. ``outputs``: the call's graph-carrying outputs; ``versions``: its input's
    and output's when it returned (``LinearCall``). Asked once the forward is done
    (``weight_units.UnitRecorder``): the module's class, forward and hooks as they are
    then, which a forward does not change."""
    if type(module) is not nn.Linear or "forward" in vars(module):  # its own forward only
        return None
    if len(args) != 1 or len(outputs) != 1:
        return None
    x, out, weight = args[0], outputs[0], module.weight
    if type(x) is not torch.Tensor or x.layout != torch.strided:
        return None
    if type(weight) is not nn.Parameter or not weight.is_contiguous():
        return None
    if not x.dtype == out.dtype == weight.dtype:
        return None
    return None if _hooked(module) else LinearCall(x, out, versions)


def _plain(param: nn.Parameter) -> bool:
    """No hook on the parameter that autograd would run for its gradient."""
    return not param._backward_hooks and not getattr(param, "_post_accumulate_grad_hooks", None)


def _accumulate(param: nn.Parameter, grad: torch.Tensor) -> None:
    """Into ``.grad`` as autograd's accumulation does: the new tensor where it is empty,
    added in place otherwise."""
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


def linear_weight(
    module: nn.Linear, call: LinearCall, grad: torch.Tensor | None, reached: list[nn.Parameter]
) -> bool:
    """W of ``call`` of ``module`` from its output's gradient (autograd's, so of the
    output's dtype and layout), into the ``.grad`` of its parameters in ``reached``; False
    (nothing done) where a parameter carries a hook or the call's tensors changed in place,
    so that autograd's W runs instead."""
    if grad is None:
        return True  # no gradient reached the output: autograd's W would do nothing
    if not call.unchanged() or not all(map(_plain, reached)):
        return False
    x = call.x
    with torch.no_grad():
        rows = grad.reshape(-1, grad.shape[-1])
        for param in reached:
            if param is not module.weight:  # the bias
                _accumulate(param, rows.sum(0))
                continue
            x_rows = x.reshape(-1, x.shape[-1])
            if _accumulates_in_place(param.grad):
                param.grad.addmm_(rows.t(), x_rows)
            else:
                _accumulate(param, rows.t().mm(x_rows))
    return True


def _accumulates_in_place(held: torch.Tensor | None) -> bool:
    """Whether the weight's product may be added inside the matrix product: a gradient is
    held, dense and contiguous (as autograd and the direct W leave it; one a user set in
    another layout is added after the product, as autograd adds). Its dtype and device
    are the weight's, and so the product's: torch refuses a ``.grad`` of any other."""
    return held is not None and held.layout == torch.strided and held.is_contiguous()
