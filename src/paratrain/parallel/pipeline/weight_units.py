"""W without redoing B: each parameter-owning module's weight gradients from its outputs.

A zero-bubble W that walks a whole layer's graph from the layer's output gradient redoes
most of B inside a transformer block (its weights sit below layer norms, the softmax and
the activation), so on a 2-stage gpt B + W cost 1.7x one backward. Instead, while a layer
runs forward, every module that owns parameters directly (a Linear, a LayerNorm, an
Embedding) has its outputs and its inputs' graph nodes recorded (a *unit*); B asks
autograd for the gradients of the layer's inputs *and* of every unit's outputs (autograd
skips the weights' products, since no weight is asked for); W then runs one backward per
unit from those outputs to its own parameters, which for a Linear is the one product
``grad_out^T @ x``.

Exact only if every path from a parameter to the layer's outputs passes through its
unit's outputs (otherwise W would miss a share: a weight also used by code outside its
module, as in a head tied by ``F.linear(x, embedding.weight)``, or a module that leaks an
inner value). ``units_of`` proves this on the graph the forward built, each micro-batch:
from each unit's outputs downwards to its inputs it collects the unit's nodes, and
accepts the unit only if no node but its outputs is consumed outside them and those
outputs are consumed only at the slots the module returned. A piece (an uncut chunk, or
one layer of a cut one) any of whose parameters is not proved so takes its W whole, from
its output (``split_backward.LayerTape``). The proof costs one walk of the piece's graph
(15 us for a gpt block of 42 nodes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.utils.hooks import RemovableHandle

from paratrain.parallel.layer_profile import tensors_in


def _graph_tensors(value: Any) -> list[torch.Tensor]:
    """The floating-point tensors in a module's arguments or outputs that carry a graph.
    Tensors inside objects it does not know (a key-value cache) are not seen; a unit
    whose outputs hide one then fails the proof (its inner nodes are consumed outside)
    and its layer keeps the whole-layer W, so a miss costs speed, never exactness."""
    return [t for t in tensors_in(value) if t.requires_grad and t.is_floating_point()]


def _node(tensor: torch.Tensor) -> Any:
    """The autograd node a tensor's gradient flows into (its grad_fn, or a leaf's
    AccumulateGrad)."""
    return tensor.grad_fn if tensor.grad_fn is not None else get_gradient_edge(tensor).node


@dataclass
class Unit:
    """One call of a module that owns parameters directly, as the forward recorded it."""

    module: nn.Module
    params: list[nn.Parameter]
    inputs: list[Any] = field(default_factory=list)
    """Graph nodes of the call's inputs: where the unit's own graph ends below."""
    outputs: list[torch.Tensor] = field(default_factory=list)
    """The call's outputs that carry a graph (inputs passed through excluded)."""
    grads: list[torch.Tensor | None] = field(default_factory=list)
    """The gradient B found at each output, kept for W."""
    nodes: set[Any] = field(default_factory=set)
    """The unit's own graph nodes (proved private by ``units_of``)."""
    reached: list[nn.Parameter] = field(default_factory=list)
    """Its parameters this call used: the ones W asks for."""
    calls: int = 0

    def backward_weight(self, *, keep_graph: bool) -> None:
        """W of this unit: its parameters' gradients from its outputs' (those B reached),
        accumulated into ``.grad`` as one backward would."""
        if not self.grads:  # B found no gradient for the layer: neither has W
            return
        pairs = [(o, g) for o, g in zip(self.outputs, self.grads, strict=True) if g is not None]
        if pairs and self.reached:
            torch.autograd.backward(
                [o for o, _ in pairs],
                [g for _, g in pairs],
                inputs=self.reached,
                retain_graph=keep_graph,
            )


def param_owners(layer: nn.Module) -> dict[nn.Module, list[nn.Parameter]] | None:
    """Each module of ``layer`` with trainable parameters of its own, and those parameters;
    None when some parameter has two owners (a weight tied inside the layer, or a module
    registered twice), which W per unit would count once per owner."""
    owners: dict[nn.Module, list[nn.Parameter]] = {}
    seen: set[int] = set()
    for _, module in layer.named_modules(remove_duplicate=False):
        params = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if not params:
            continue
        if module in owners or any(id(p) in seen for p in params):
            return None
        seen.update(id(p) for p in params)
        owners[module] = params
    return owners


class UnitRecorder:
    """While open, records each call of the given modules (hooks on those modules only,
    removed on leaving, so no module of the user's model keeps a hook of ours and the
    modules that own nothing keep torch's fast call path)."""

    def __init__(self, owners: dict[nn.Module, list[nn.Parameter]]) -> None:
        self.units = {module: Unit(module, params) for module, params in owners.items()}
        self._handles: list[RemovableHandle] = []

    def __enter__(self) -> UnitRecorder:
        self._handles = [
            handle
            for module in self.units
            for handle in (
                module.register_forward_pre_hook(self._before),
                module.register_forward_hook(self._after),
            )
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()

    def _before(self, module: nn.Module, args: Any) -> None:
        unit = self.units[module]
        unit.calls += 1
        unit.inputs = [_node(t) for t in _graph_tensors(args)]

    def _after(self, module: nn.Module, args: Any, output: Any) -> None:
        passed = {id(t) for t in _graph_tensors(args)}
        self.units[module].outputs = [t for t in _graph_tensors(output) if id(t) not in passed]


def units_of(recorder: UnitRecorder, layer_outputs: list[torch.Tensor]) -> list[Unit] | None:
    """The layer's units if W per unit is exact for every parameter of the layer (see the
    module docstring), else None."""
    consumers = _consumers([_node(t) for t in layer_outputs])
    accumulators = _accumulators(consumers)
    units = list(recorder.units.values())
    for unit in units:
        unit.reached = [p for p in unit.params if id(p) in accumulators]
        own = {accumulators[id(p)] for p in unit.reached}
        if unit.calls > 1 or (unit.calls == 0 and own):
            return None  # called twice, or its parameters used without it being called
        if unit.calls == 1 and not _private(unit, own, consumers):
            return None
    return [unit for unit in units if unit.calls == 1 and unit.outputs]


def _accumulators(consumers: dict[Any, list[Any]]) -> dict[int, Any]:
    """The leaves' gradient accumulators under the layer, by their tensor's id."""
    found = {}
    for node in consumers:
        variable = getattr(node, "variable", None)
        if variable is not None:
            found[id(variable)] = node
    return found


def _consumers(roots: list[Any]) -> dict[Any, list[Any]]:
    """For each node under ``roots``, the nodes that take its output (one entry per edge)."""
    consumers: dict[Any, list[Any]] = {}
    seen, stack = set(), list(roots)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for below, _ in node.next_functions:
            if below is not None:
                consumers.setdefault(below, []).append(node)
                stack.append(below)
    return consumers


def _private(unit: Unit, own: set[Any], consumers: dict[Any, list[Any]]) -> bool:
    """Whether every path from the unit's parameters (``own``: their accumulators) up to
    the layer's outputs leaves the unit through an output slot the module returned."""
    slots: dict[Any, set[int]] = {}
    for tensor in unit.outputs:
        slots.setdefault(_node(tensor), set()).add(tensor.output_nr)
    stop = set(unit.inputs)
    nodes, stack = set(), list(slots)
    while stack:
        node = stack.pop()
        if node in nodes or node in stop:
            continue
        if not node.next_functions and node not in own:
            continue  # another leaf: an input passed in some other way, or a foreign weight
        nodes.add(node)
        stack.extend(below for below, _ in node.next_functions if below is not None)
    if not own <= nodes:
        return False  # a parameter used in the layer, but not on the way to the outputs
    for node in nodes:
        outside = [c for c in consumers.get(node, ()) if c not in nodes]
        if outside and node not in slots:
            return False  # an inner value (or a parameter) is used outside the module
        for consumer in outside:
            taken = {slot for below, slot in consumer.next_functions if below is node}
            if not taken <= slots[node]:
                return False  # a slot of the output node the module did not return
    unit.nodes = nodes
    return True


def overlapping(units: list[Unit]) -> bool:
    """Whether two units share graph nodes (a unit nested in another), so that W must keep
    the graph until every unit's W ran."""
    seen: set[Any] = set()
    for unit in units:
        if seen & unit.nodes:
            return True
        seen |= unit.nodes
    return False
