"""W unit by unit (``weight_units``): the same gradients as one backward, and the whole-
layer W wherever the graph cannot prove a module's outputs carry all its weights' paths.

Tolerance: a unit's W runs the same kernels on the same tensors as one backward does for
that weight (a Linear's ``grad_out^T @ x``, a LayerNorm's weight reduction), so the
gradients are equal up to a kernel that computes the weight's part alone reducing in
another order: fp32 rounding of 2^-24 per add over at most the 512 rows summed here,
about 3e-5 relative, so rtol 6e-5 (atol 1e-7 for entries near 0). Measured: 0.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from paratrain.models import build_model
from paratrain.parallel.pipeline.split_backward import ChunkOwners, LayerTape
from paratrain.parallel.pipeline.weight_units import (
    UnitHooks,
    UnitRecorder,
    param_owners,
    units_of,
)

RTOL, ATOL = 6e-5, 1e-7


def _grads_both_ways(
    layers: nn.Sequential, x: torch.Tensor, *, whole: bool = False
) -> tuple[list, list, list[bool]]:
    """(one backward's input and weight gradients, the tape's, which of the tape's pieces
    W takes unit by unit)."""
    torch.manual_seed(1)
    upstream = torch.randn_like(layers(x))
    x1 = x.detach().requires_grad_(True)
    layers(x1).backward(upstream)
    reference = [x1.grad, *[p.grad.clone() for p in layers.parameters()]]
    layers.zero_grad(set_to_none=True)
    tape = LayerTape(whole=whole)
    x2 = x.detach().requires_grad_(True)
    tape.run(layers, (x2,), {})
    kinds = [layer.units is not None for layer in tape.layers]
    (input_grad,) = tape.backward_input([upstream])
    tape.backward_weight()
    split = [input_grad, *[p.grad.clone() for p in layers.parameters()]]
    layers.zero_grad(set_to_none=True)
    return reference, split, kinds


def _assert_same(reference: list, split: list) -> None:
    for ref, got in zip(reference, split, strict=True):
        torch.testing.assert_close(got, ref, rtol=RTOL, atol=ATOL)


def test_a_gpt_blocks_weights_come_from_each_modules_outputs_and_equal_one_backward():
    torch.manual_seed(0)
    model = build_model("gpt", vocab_size=65, block_size=16, n_layer=3, n_head=4, n_embd=32)
    blocks = nn.Sequential(*list(model)[1:4])
    reference, split, per_unit = _grads_both_ways(blocks, torch.randn(4, 16, 32))
    assert per_unit == [True, True, True]
    _assert_same(reference, split)


def test_a_gpt_blocks_w_does_not_redo_its_b():
    """The point of units: W runs only the weights' products. Counted in operators (not
    time): a whole-layer W of a block re-runs its attention's backward, a unit W none."""
    torch.manual_seed(0)
    model = build_model("gpt", vocab_size=65, block_size=16, n_layer=1, n_head=4, n_embd=32)
    block = nn.Sequential(model[1])
    x = torch.randn(2, 16, 32, requires_grad=True)
    tape = LayerTape()
    tape.run(block, (x,), {})
    tape.backward_input([torch.ones(2, 16, 32)])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        tape.backward_weight()
    names = {event.name for event in prof.events()}
    assert not any("attention" in name.lower() for name in names), sorted(names)


class _TiedHead(nn.Module):
    """A head that uses another module's weight through ``F.linear``: that weight's
    Linear's outputs do not carry all of its paths."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(self.inner(x)), self.inner.weight)


class _Twice(nn.Module):
    """One Linear called twice: its second call's outputs depend on its first call."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(torch.tanh(self.shared(x)))


class _Leaky(nn.Linear):
    """Keeps an inner value that the layer uses after the module returned."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.kept = torch.sigmoid(x * self.weight[0])
        return super().forward(x)


class _UsesLeak(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.leaky = _Leaky(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.leaky(x) * self.leaky.kept


class _Scaled(nn.Module):
    """Owns a Parameter of its own around a child Linear: its unit holds the child's
    graph too (nested units)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((8,), 1.5))
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x * self.scale))


class _Shift(nn.Module):
    """Adds a Parameter of its own: its backward saves nothing of its input."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.shift


class _ChangesInputAfter(nn.Module):
    """Changes a module's input in place after the module's call. The call's units are
    made once the forward is done, so that input then names the in-place op's node: the
    proof's walk goes on past the call's input, meets the in-place op's use of it, and
    fails (the whole W), where it could have proved the unit."""

    def __init__(self) -> None:
        super().__init__()
        self.shifted = _Shift()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 3
        y = self.shifted(h)
        h.mul_(2)
        return y * h


@pytest.mark.parametrize(
    ("layer", "per_unit"),
    [
        (_TiedHead, False),
        (_Twice, False),
        (_UsesLeak, False),
        (_Scaled, True),
        (_ChangesInputAfter, False),
    ],
    ids=[
        "weight-used-outside-its-module",
        "module-called-twice",
        "inner-value-leaks",
        "nested",
        "input-changed-in-place-after-the-call",
    ],
)
def test_a_layer_w_takes_unit_by_unit_only_where_the_graph_proves_it_exact(layer, per_unit):
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(8, 8), layer(), nn.Linear(8, 8))
    reference, split, kinds = _grads_both_ways(layers, torch.randn(5, 8))
    assert kinds == [True, per_unit, True]
    _assert_same(reference, split)


@pytest.mark.parametrize(
    ("layer", "proved"),
    [(_TiedHead, False), (_Twice, False), (_UsesLeak, False), (_Scaled, True)],
    ids=["weight-used-outside-its-module", "module-called-twice", "inner-value-leaks", "nested"],
)
def test_an_uncut_chunk_equals_one_backward_and_one_that_fails_the_proof_says_so(layer, proved):
    """``LayerTape(whole=True)``: the chunk uncut, one piece; where the graph fails the
    proof, this micro-batch's W walks the whole chunk (exact) and ``whole`` turns False so
    that the engine cuts the chunk from then on."""
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(8, 8), layer(), nn.Linear(8, 8))
    tape = LayerTape(whole=True)
    tape.run(layers, (torch.randn(5, 8, requires_grad=True),), {})
    assert tape.whole is proved
    reference, split, per_unit = _grads_both_ways(layers, torch.randn(5, 8), whole=True)
    assert per_unit == [proved]
    _assert_same(reference, split)


def test_an_uncut_gpt_stage_equals_one_backward():
    torch.manual_seed(0)
    model = build_model("gpt", vocab_size=65, block_size=16, n_layer=3, n_head=4, n_embd=32)
    blocks = nn.Sequential(*list(model)[1:5])
    reference, split, per_unit = _grads_both_ways(blocks, torch.randn(4, 16, 32), whole=True)
    assert per_unit == [True]
    _assert_same(reference, split)


def test_a_first_stage_fed_token_ids_defers_its_whole_backward_to_w():
    """A first stage's input carries no gradient, so B has nothing to send back: it does
    nothing (no weight has a gradient after it, no unit was recorded) and W, one whole
    backward from the kept output gradient, gives the embedding and every block theirs."""
    torch.manual_seed(0)
    model = build_model("gpt", vocab_size=65, block_size=16, n_layer=2, n_head=4, n_embd=32)
    stage = nn.Sequential(*list(model)[:3])
    tokens = torch.randint(0, 65, (4, 16))
    upstream = torch.randn(4, 16, 32)
    stage(tokens).backward(upstream)
    reference = [p.grad.clone() for p in stage.parameters()]
    stage.zero_grad(set_to_none=True)
    tape = LayerTape(whole=True)
    tape.run(stage, (tokens,), {})
    assert [layer.units for layer in tape.layers] == [None]
    assert tape.backward_input([upstream]) == []
    assert all(p.grad is None for p in stage.parameters())
    tape.backward_weight()
    for p, ref in zip(stage.parameters(), reference, strict=True):
        torch.testing.assert_close(p.grad, ref, rtol=RTOL, atol=ATOL)


def test_a_rounds_owners_hook_each_owner_once_and_leave_no_hook_behind():
    """The engine hooks a chunk's owners once for a round (``ChunkOwners``); every tape of
    the round records through them, each micro-batch's units its own, and leaving the
    round removes every hook, so the user's model keeps none."""
    torch.manual_seed(0)
    model = build_model("gpt", vocab_size=65, block_size=16, n_layer=3, n_head=4, n_embd=32)
    blocks = nn.Sequential(*list(model)[1:4])
    owners = param_owners(blocks)
    with ChunkOwners.of_layers(blocks) as chunk:
        for module in blocks.modules():
            assert len(module._forward_hooks) == (1 if module in owners else 0)
        for _ in range(2):
            x = torch.randn(4, 16, 32)
            blocks(x.clone().requires_grad_(True)).backward(torch.ones(4, 16, 32))
            reference = [p.grad.clone() for p in blocks.parameters()]
            blocks.zero_grad(set_to_none=True)
            tape = LayerTape(whole=True, owners=chunk)
            out = tape.run(blocks, (x.clone().requires_grad_(True),), {})
            assert tape.whole and len(tape.layers[0].units) == len(owners)
            tape.backward_input([torch.ones_like(out)])
            tape.backward_weight()
            _assert_same(reference, [p.grad for p in blocks.parameters()])
            blocks.zero_grad(set_to_none=True)
    assert not any(module._forward_hooks for module in blocks.modules())


def test_the_proof_pauses_the_cyclic_collector_and_restores_it():
    """``units_of`` pauses gc for its walk and leaves it as it found it."""
    torch.manual_seed(0)
    layer = nn.Linear(8, 8)
    for enabled in (True, False):
        (gc.enable if enabled else gc.disable)()
        try:
            owners = param_owners(layer)
            recorder = UnitRecorder(owners)
            with UnitHooks(list(owners)) as hooks:
                hooks.recorder = recorder
                out = layer(torch.randn(2, 8, requires_grad=True))
            assert units_of(recorder, [out]) is not None
            assert gc.isenabled() is enabled
        finally:
            gc.enable()


class _KeepsInner(nn.Module):
    """Owns its weight and keeps the value under its activation, which the layer above
    returns as an output of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.pre = x @ self.weight
        return torch.tanh(self.pre)


class _ReturnsInner(nn.Module):
    """Its outputs: the module's and the module's inner value. The inner value is a
    root of the graph inside the unit: nothing consumes it there, yet the gradient it
    receives reaches the weight without passing the unit's output."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _KeepsInner()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner(x), self.inner.pre


@pytest.mark.parametrize("whole", [False, True], ids=["cut", "uncut"])
def test_a_layer_output_inside_a_unit_fails_the_proof_and_w_stays_exact(whole):
    """The layer's outputs are the graph's roots: one taken inside a unit (not at a slot
    the module returned) is a use outside the module, as a consumer there would be. A
    proof that counted consumers only accepted it, and W unit by unit lost that output's
    share of the weight's gradient."""
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(8, 8), _ReturnsInner())
    x = torch.randn(5, 8)
    upstream = [torch.randn(5, 8), torch.randn(5, 8)]
    x1 = x.clone().requires_grad_(True)
    torch.autograd.backward(list(layers(x1)), upstream)
    reference = [x1.grad, *[p.grad.clone() for p in layers.parameters()]]
    layers.zero_grad(set_to_none=True)
    tape = LayerTape(whole=whole)
    tape.run(layers, (x.clone().requires_grad_(True),), {})
    assert tape.layers[-1].units is None
    (input_grad,) = tape.backward_input(upstream)
    tape.backward_weight()
    _assert_same(reference, [input_grad, *[p.grad for p in layers.parameters()]])
