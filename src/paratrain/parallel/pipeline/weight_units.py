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
inner value, or a layer that returns a value from inside a module). ``units_of`` proves
this on the graph the forward built, each micro-batch: from each unit's outputs downwards
to its inputs it collects the unit's nodes, and accepts the unit only if every use of
those nodes from outside them (another node's edge, or one of the layer's outputs, where
a gradient enters the graph as it does through an edge) takes an output slot the module
returned. A piece (an uncut chunk, or one layer of a cut one) any of whose parameters is
not proved so takes its W whole, from its output (``split_backward.LayerTape``). The
proof costs one walk of the piece's graph (about 0.2 ms a gpt block of 42 nodes on a
fresh graph, whose node wrappers it creates).
A plain ``nn.Linear``'s W skips autograd altogether (``linear_weight``): the same product
and sum, made directly from the input its call recorded.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.utils.hooks import RemovableHandle

from paratrain.parallel.layer_profile import tensors_in
from paratrain.parallel.pipeline.linear_weight import LinearCall, linear_call, linear_weight


def graph_tensors(value: Any) -> list[torch.Tensor]:
    """The floating-point tensors in a module's arguments or outputs that carry a graph.
    Tensors inside objects it does not know (a key-value cache) are not seen; a unit
    whose outputs hide one then fails the proof (its inner nodes are consumed outside)
    and its layer keeps the whole-layer W, so a miss costs speed, never exactness."""
    if type(value) is tuple and len(value) == 1:  # a module's one argument: the usual call
        value = value[0]
    if type(value) is torch.Tensor:
        return [value] if value.requires_grad and value.is_floating_point() else []
    return [t for t in tensors_in(value) if t.requires_grad and t.is_floating_point()]


def _node(tensor: torch.Tensor) -> Any:
    """The autograd node a tensor's gradient flows into (its grad_fn, or a leaf's
    AccumulateGrad)."""
    return tensor.grad_fn if tensor.grad_fn is not None else get_gradient_edge(tensor).node


@dataclass(slots=True)
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
    direct: LinearCall | None = None
    """A plain ``nn.Linear``'s call, where its W may be taken without autograd
    (``linear_weight``); None otherwise."""

    def backward_weight(self, *, keep_graph: bool) -> None:
        """W of this unit: its parameters' gradients from its outputs' (those B reached),
        accumulated into ``.grad`` as one backward would."""
        if not self.grads:  # B found no gradient for the layer: neither has W
            return
        if self.direct is not None and linear_weight(
            self.module, self.direct, self.grads[0], self.reached
        ):
            self.direct = None
            return
        pairs = [(o, g) for o, g in zip(self.outputs, self.grads, strict=True) if g is not None]
        if pairs and self.reached:
            torch.autograd.backward(
                [o for o, _ in pairs],
                [g for _, g in pairs],
                inputs=self.reached,
                retain_graph=keep_graph,
            )


def param_owners(
    layer: nn.Module, held: Callable[[str], bool] | None = None
) -> dict[nn.Module, list[nn.Parameter]] | None:
    """Each module of ``layer`` with trainable parameters of its own, and those parameters;
    None when some parameter has two owners (a weight tied inside the layer, or a module
    registered twice), which W per unit would count once per owner. ``held``: which
    parameters count, by their name under ``layer`` (all by default; a piece of a model
    cut at named split points counts its own)."""
    owners: dict[nn.Module, list[nn.Parameter]] = {}
    seen: set[int] = set()
    for name, module in layer.named_modules(remove_duplicate=False):
        params = [
            p
            for key, p in module.named_parameters(recurse=False)
            if p.requires_grad and (held is None or held(f"{name}.{key}" if name else key))
        ]
        if not params:
            continue
        if module in owners or any(id(p) in seen for p in params):
            return None
        seen.update(id(p) for p in params)
        owners[module] = params
    return owners


class UnitRecorder:
    """One forward's calls of the given modules, as ``UnitHooks`` reports them.

    The hook only keeps each call as it came (the module, its arguments and output, and
    the versions a direct W checks later); the calls become units once the forward is
    done (``units``). Why: Python run between a forward's matrix products finds its code
    and data out of the caches, so the same checks made 26 times in a row after the
    forward cost a fraction of what they cost one per call inside it (on the bench's
    2-stage gpt last stage, one thread: the recorded forward 0.47 ms longer than the
    hooked one with the checks in the hook; see docs/benchmarks.md)."""

    def __init__(self, owners: dict[nn.Module, list[nn.Parameter]]) -> None:
        self.owners = owners
        self.calls: list[tuple[nn.Module, Any, Any, tuple[int, int] | None]] = []
        self._units: dict[nn.Module, Unit] | None = None

    def record(self, module: nn.Module, args: Any, output: Any) -> None:
        self.calls.append((module, args, output, call_versions(args, output)))

    @property
    def units(self) -> dict[nn.Module, Unit]:
        """Every owner's unit: its calls counted, its last call's inputs and outputs."""
        if self._units is None:
            self._units = {module: Unit(module, params) for module, params in self.owners.items()}
            for module, args, output, versions in self.calls:
                unit = self._units.get(module)
                if unit is not None:  # an owner of another layer of the chunk is not taped
                    _note_call(unit, args, output, versions)
            self.calls = []
        return self._units


def call_versions(args: Any, output: Any) -> tuple[int, int] | None:
    """The versions of a call's one tensor input and its tensor output when it returned:
    all a direct W needs to see an in-place change made after the call (None where the
    call is not one input and one output tensor, which no direct W takes)."""
    if type(output) is torch.Tensor and type(args) is tuple and len(args) == 1:
        x = args[0]
        if type(x) is torch.Tensor:
            return x._version, output._version
    return None


def _note_call(unit: Unit, args: Any, output: Any, versions: tuple[int, int] | None) -> None:
    """One recorded call on its unit, once the forward is done. The inputs' nodes are read
    then: an input changed in place after the call names a node above the call's, and the
    proof's walk from the unit's outputs then goes on past the call's input into nodes
    that other code uses, which fails it (the whole W, exact)."""
    unit.calls += 1
    inputs = graph_tensors(args)
    unit.inputs = [_node(t) for t in inputs]
    passed = {id(t) for t in inputs}
    unit.outputs = [t for t in graph_tensors(output) if id(t) not in passed]
    unit.direct = None
    if versions is not None:  # one tensor in, one out: perhaps a Linear's direct W
        unit.direct = linear_call(unit.module, args, unit.outputs, versions)


class UnitHooks:
    """One forward hook on each of the given modules, reporting their calls to the
    ``recorder`` in place (none: the call is not recorded).

    Registered for a round of the schedule, not per forward: registering and removing two
    hooks on each of a gpt stage's 24 owners cost about as much as the proof itself, eight
    times a step. Removed on leaving, so no module of the user's model keeps a hook of
    ours between steps, and the modules that own nothing keep torch's fast call path.
    """

    def __init__(self, modules: list[nn.Module]) -> None:
        self.modules = modules
        self.recorder: UnitRecorder | None = None
        self._handles: list[RemovableHandle] = []

    def __enter__(self) -> UnitHooks:
        self._handles = [module.register_forward_hook(self._after) for module in self.modules]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.recorder = None

    def _after(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.recorder is not None:
            self.recorder.record(module, args, output)


def units_of(recorder: UnitRecorder, layer_outputs: list[torch.Tensor]) -> list[Unit] | None:
    """The layer's units if W per unit is exact for every parameter of the layer (see the
    module docstring), else None.

    Python's cyclic collector is paused for the walk: it creates a wrapper for each graph
    node and a tuple for each edge, which set off half the collections a gpt stage's
    micro-batch ran into (0.9 young collections a micro-batch with the walk counted, 0.45
    paused); the walk makes no cycles, so what it allocates is freed by reference counting
    as it returns."""
    paused = gc.isenabled()
    gc.disable()
    try:
        return _proved_units(recorder, layer_outputs)
    finally:
        if paused:
            gc.enable()


def _proved_units(recorder: UnitRecorder, layer_outputs: list[torch.Tensor]) -> list[Unit] | None:
    graph = _Graph([_edge(t) for t in layer_outputs])
    units = list(recorder.units.values())
    for unit in units:
        unit.reached = [p for p in unit.params if id(p) in graph.accumulators]
        own = {graph.accumulators[id(p)] for p in unit.reached}
        if unit.calls > 1 or (unit.calls == 0 and own):
            return None  # called twice, or its parameters used without it being called
        if unit.calls == 1 and not _private(unit, own, graph):
            return None
    return [unit for unit in units if unit.calls == 1 and unit.outputs]


def _edge(tensor: torch.Tensor) -> tuple[Any, int]:
    """Where a tensor's gradient enters the graph: its node and the node's output slot, as
    a consumer's ``next_functions`` names it (torch's ``GradientEdge`` carries a third
    field, so it is no such pair itself)."""
    edge = get_gradient_edge(tensor)
    return edge.node, edge.output_nr


class _Graph:
    """The graph under some roots, walked once: each node's edges below (``next_functions``
    builds its tuples anew on each read), how many edges take each node's output in all
    and at each of its slots, and the leaves' gradient accumulators by their tensor's id.
    The roots (the layer's outputs) count as uses too: a gradient arrives there from above
    as it does through a consumer's edge, so a layer output taken inside a unit is a use of
    that value outside the unit."""

    def __init__(self, roots: list[tuple[Any, int]]) -> None:
        self.below: dict[Any, tuple] = {}
        self.uses: dict[Any, int] = {}
        self.slot_uses: dict[tuple[Any, int], int] = {}
        uses, slot_uses, below = self.uses, self.slot_uses, self.below
        for root in roots:
            uses[root[0]] = uses.get(root[0], 0) + 1
            slot_uses[root] = slot_uses.get(root, 0) + 1
        stack = [node for node, _ in roots]
        while stack:
            node = stack.pop()
            if node in below:
                continue
            edges = node.next_functions
            below[node] = edges
            for edge in edges:
                under = edge[0]
                if under is not None:
                    uses[under] = uses.get(under, 0) + 1
                    slot_uses[edge] = slot_uses.get(edge, 0) + 1
                    stack.append(under)
        self.accumulators = {}
        for node, edges in below.items():
            if edges:
                continue  # a leaf's accumulator has no edges below (and only it a variable)
            variable = getattr(node, "variable", None)
            if variable is not None:
                self.accumulators[id(variable)] = node


def _private(unit: Unit, own: set[Any], graph: _Graph) -> bool:
    """Whether every path from the unit's parameters (``own``: their accumulators) up to
    the layer's outputs leaves the unit through an output slot the module returned: every
    use of a unit's node from outside it (an edge from a node not in the unit, or a layer
    output) takes a slot the module returned, counted as the graph's uses less the unit's
    own edges."""
    slots: dict[Any, set[int]] = {}
    for tensor in unit.outputs:
        slots.setdefault(_node(tensor), set()).add(tensor.output_nr)
    stop = set(unit.inputs)
    nodes, stack = set(), list(slots)
    while stack:
        node = stack.pop()
        if node in nodes or node in stop:
            continue
        edges = graph.below.get(node, ())
        if not edges and node not in own:
            continue  # another leaf: an input passed in some other way, or a foreign weight
        nodes.add(node)
        for edge in edges:
            if edge[0] is not None:
                stack.append(edge[0])
    if not own <= nodes:
        return False  # a parameter used in the layer, but not on the way to the outputs
    inside: dict[Any, int] = {}
    inside_slots: dict[tuple[Any, int], int] = {}
    for node in nodes:
        for edge in graph.below.get(node, ()):
            if edge[0] in nodes:
                inside[edge[0]] = inside.get(edge[0], 0) + 1
                inside_slots[edge] = inside_slots.get(edge, 0) + 1
    for node in nodes:
        outside = graph.uses.get(node, 0) - inside.get(node, 0)
        if not outside:
            continue
        returned = slots.get(node)
        if returned is None:
            return False  # an inner value (or a parameter) is used outside the module
        at_returned = sum(
            graph.slot_uses.get((node, slot), 0) - inside_slots.get((node, slot), 0)
            for slot in returned
        )
        if at_returned != outside:
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
