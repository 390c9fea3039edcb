"""A plain Linear's W taken directly (``linear_weight``): the gradients autograd's W makes,
and autograd's W wherever anything could act between the module and its gradients.

Tolerance: none for one micro-batch on a contiguous input. autograd's backward of ``addmm``
makes the weight's gradient of a column-major ``weight.t()`` as ``grad.t().mm(input_rows)``
and the bias's as the sum of the gradient's rows, then sets each as ``.grad``; the direct
W makes the same two calls on the same tensors, so the results are equal bit for bit.
Accumulated over micro-batches, autograd adds each product into ``.grad`` after making
it, the direct W inside the product (``addmm_``): the same sums in the kernel's order,
which may differ in the last place. A non-contiguous 3-D input goes through ``matmul``
and a separate bias add, whose bias gradient sums over two dimensions at once: the same
sum in another order. Where autograd's W must run (a hook, a change in place), the
gradients are held against one backward. All but the first use ``test_weight_units``'s
tolerance, derived there for sums in another order over up to 512 rows (fp32 rounding
of 2^-24 per add, rtol 6e-5, atol 1e-7 near 0); the sums here run over at most 512 rows.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import paratrain.parallel.pipeline.weight_units as weight_units
from paratrain.parallel.pipeline.linear_weight import LinearCall, linear_weight
from paratrain.parallel.pipeline.split_backward import ChunkOwners, LayerTape


def _stack(bias_last: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 8, bias=bias_last))


def _tape_grads(layers: nn.Module, inputs: list[torch.Tensor]) -> tuple[list, list[bool]]:
    """The parameters' gradients after B and W of each input in turn (accumulated), and
    which units the tape took directly."""
    layers.zero_grad(set_to_none=True)
    taken: list[bool] = []
    with ChunkOwners.of_layers(layers) as owners:
        for x in inputs:
            tape = LayerTape(whole=True, owners=owners)
            out = tape.run(layers, (x.clone().requires_grad_(True),), {})
            taken += [unit.direct is not None for unit in tape.layers[0].units]
            tape.backward_input([torch.ones_like(out)])
            tape.backward_weight()
    return [p.grad.clone() for p in layers.parameters()], taken


def _autograd_grads(layers: nn.Module, inputs: list[torch.Tensor], monkeypatch) -> list:
    with monkeypatch.context() as patch:
        patch.setattr(weight_units, "linear_call", lambda *args: None)
        grads, taken = _tape_grads(layers, inputs)
    assert not any(taken)
    return grads


@pytest.mark.parametrize("shape", [(6, 16), (2, 3, 16)], ids=["2-d", "3-d"])
@pytest.mark.parametrize("bias_last", [True, False], ids=["bias", "no-bias"])
def test_direct_w_equals_autograds_bit_for_bit_on_one_micro_batch(shape, bias_last, monkeypatch):
    layers = _stack(bias_last)
    inputs = [torch.randn(shape)]
    direct, taken = _tape_grads(layers, inputs)
    assert taken == [True, True]
    for got, want in zip(direct, _autograd_grads(layers, inputs, monkeypatch), strict=True):
        assert torch.equal(got, want)


def _counting_addmm(monkeypatch) -> list[tuple[int, ...]]:
    """The shapes of the tensors ``addmm_`` is called on from now on (the direct W's
    accumulation inside the product)."""
    calls: list[tuple[int, ...]] = []
    real = torch.Tensor.addmm_

    def addmm_(self, *args, **kwargs):
        calls.append(tuple(self.shape))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "addmm_", addmm_)
    return calls


@pytest.mark.parametrize("shape", [(6, 16), (2, 3, 16), (512, 16)], ids=["2-d", "3-d", "512"])
def test_a_held_gradient_takes_the_next_micro_batchs_product_inside_the_matrix_product(
    shape, monkeypatch
):
    """Each micro-batch after the first adds its weight's product inside ``addmm_`` (no
    weight-sized product made and added apart), to autograd's sums within rounding."""
    layers = _stack()
    inputs = [torch.randn(shape) for _ in range(3)]
    want = _autograd_grads(layers, inputs, monkeypatch)
    calls = _counting_addmm(monkeypatch)
    direct, taken = _tape_grads(layers, inputs)
    assert all(taken)
    assert calls == [(24, 16), (8, 24)] * 2  # each weight, micro-batches 2 and 3
    for got, expected in zip(direct, want, strict=True):
        torch.testing.assert_close(got, expected, rtol=6e-5, atol=1e-7)


def test_a_held_gradient_that_is_not_contiguous_is_added_after_the_product(monkeypatch):
    """Only a contiguous ``.grad`` (what autograd and the direct W leave there) takes the
    product inside ``addmm_``; one of another layout (a transposed one a user set) gets
    the product made apart and added, as autograd's accumulation adds."""
    layers = _stack()
    x = torch.randn(6, 16)
    first = layers[0].weight
    held = torch.randn(first.shape[1], first.shape[0]).t()  # the weight's shape, transposed
    calls = _counting_addmm(monkeypatch)
    layers.zero_grad(set_to_none=True)
    with ChunkOwners.of_layers(layers) as owners:
        tape = LayerTape(whole=True, owners=owners)
        out = tape.run(layers, (x.clone().requires_grad_(True),), {})
        first.grad = held.clone()
        tape.backward_input([torch.ones_like(out)])
        tape.backward_weight()
    assert calls == []
    got = first.grad.clone()
    layers.zero_grad(set_to_none=True)
    layers(x).sum().backward()
    torch.testing.assert_close(got, held + first.grad, rtol=6e-5, atol=1e-7)


def test_a_non_contiguous_input_gives_the_same_sums_in_another_order(monkeypatch):
    layers = _stack()
    inputs = [torch.randn(16, 3, 2).transpose(0, 2) for _ in range(2)]  # (2, 3, 16), strided
    direct, taken = _tape_grads(layers, inputs)
    assert all(taken)
    for got, want in zip(direct, _autograd_grads(layers, inputs, monkeypatch), strict=True):
        torch.testing.assert_close(got, want, rtol=6e-5, atol=1e-7)


class _MyLinear(nn.Linear):
    """A subclass: its forward may differ from ``F.linear``, so it keeps autograd's W."""


def _recorded_direct(module: nn.Module, *args: torch.Tensor, **kwargs) -> LinearCall | None:
    """What the round's hook records as ``module``'s direct input on one call (its units
    made inside the round, as the tape makes them, the hook still on)."""
    with ChunkOwners.of_layers(nn.Sequential(module)) as owners:
        _, recorder = owners.record(owners.owners, module, *args, **kwargs)
        return recorder.units[module].direct


def test_only_a_plain_linear_called_on_its_input_alone_and_unhooked_is_taken_directly():
    x = torch.randn(4, 16, requires_grad=True)
    assert _recorded_direct(nn.Linear(16, 8), x).x is x
    assert _recorded_direct(_MyLinear(16, 8), x) is None
    patched = nn.Linear(16, 8)
    patched.forward = lambda inputs: nn.functional.linear(inputs, patched.weight * 2)
    assert _recorded_direct(patched, x) is None
    assert _recorded_direct(nn.Linear(16, 8), input=x) is None  # a keyword input
    doubled = nn.Linear(16, 8)
    doubled.register_forward_hook(lambda module, args, out: out * 2)
    assert _recorded_direct(doubled, x) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the product ran on cast copies
        assert _recorded_direct(nn.Linear(16, 8), x) is None
    handle = nn.modules.module.register_module_forward_pre_hook(lambda module, args: None)
    try:
        assert _recorded_direct(nn.Linear(16, 8), x) is None
    finally:
        handle.remove()


def test_a_linear_whose_output_a_hook_changes_keeps_one_backwards_gradients():
    """The hook scales the output: only autograd's W sees that the weight's gradient is
    twice ``grad_out^T @ x``."""
    layers = _stack()
    layers[2].register_forward_hook(lambda module, args, out: out * 2)
    x = torch.randn(6, 16)
    direct, taken = _tape_grads(layers, [x])
    assert taken == [True, False]  # a unit per Linear: the hooked one not direct
    layers.zero_grad(set_to_none=True)
    layers(x).sum().backward()
    for got, param in zip(direct, layers.parameters(), strict=True):
        torch.testing.assert_close(got, param.grad, rtol=6e-5, atol=1e-7)


def test_a_parameter_with_a_hook_gets_autograds_w_and_its_hook_runs_once_a_micro_batch():
    layers = _stack()
    calls = []
    layers[0].weight.register_post_accumulate_grad_hook(lambda param: calls.append(1))
    x = torch.randn(6, 16)
    grads, taken = _tape_grads(layers, [x, x])
    assert all(taken)  # recorded as direct, then refused at W time for the hook
    assert len(calls) == 2
    layers.zero_grad(set_to_none=True)
    (layers(x).sum() * 2).backward()
    for got, param in zip(grads, layers.parameters(), strict=True):
        torch.testing.assert_close(got, param.grad, rtol=6e-5, atol=1e-7)


def test_a_missing_output_gradient_adds_nothing():
    linear = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    out = linear(x)
    call = LinearCall(x, out, (x._version, out._version))
    assert linear_weight(linear, call, None, list(linear.parameters()))
    assert linear.weight.grad is None and linear.bias.grad is None


class _DoubledInPlace(nn.Module):
    """Changes its Linear's output in place after the call: the gradient B finds at that
    output must still pass the ``mul_`` to reach the weight."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        y.mul_(2)
        return torch.tanh(y)


def test_an_output_changed_in_place_after_the_call_keeps_autograds_w():
    torch.manual_seed(0)
    layers = nn.Sequential(_DoubledInPlace())
    x = torch.randn(6, 16)
    grads, taken = _tape_grads(layers, [x])
    assert taken == [True]  # recorded as direct, then refused at W time for the change
    layers.zero_grad(set_to_none=True)
    layers(x).sum().backward()
    for got, param in zip(grads, layers.parameters(), strict=True):
        torch.testing.assert_close(got, param.grad, rtol=6e-5, atol=1e-7)
