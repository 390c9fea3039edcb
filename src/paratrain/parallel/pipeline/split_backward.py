"""A stage's backward split in two, as zero-bubble schedules need: B, then W.

B computes the gradient of the stage's input (what the previous stage waits for); W the
gradients of the stage's weights (which nobody waits for), later, where the schedule has
an idle slot. ``torch.autograd.grad`` towards the input alone skips the weights' matrix
products, but a later backward towards the weights from the stage's output would redo
the whole input-gradient chain. So W starts from each parameter-owning module's outputs
(``weight_units``): B asks for their gradients besides the input's and keeps them, and W
runs one small backward per module to its own weights. That is exact where the graph
proves every path from a weight to the output passes through its module's outputs,
checked each micro-batch. A chunk runs uncut, one piece, while its graphs pass; once one
fails (a weight also used outside its module, a module called twice), that micro-batch's
W walks the whole chunk from its output (exact, B's work again) and the chunk is cut
between layers from then on (each layer's input a detached copy that requires grad, as
a stage's received input is): B walks the layers down, each proved on its own, and a
layer that fails takes its W from the gradient that reached its output, redoing the
layer's work between its weights and its output. Recompute always cuts (each layer is
checkpointed). A chunk fed data (the first) has no input gradient to send: its B does
nothing and its W is the chunk's one whole backward, as torch's zero-bubble stages do.

A piece of a model cut at named split points (``stage_run``) is no list of layers: it
runs uncut (``run_piece``), its units proved each micro-batch, and a graph that fails the
proof takes that micro-batch's W whole from the piece's output.

Exact: every gradient is the same product of the same tensors as in one backward; a
Parameter used by several layers gets each layer's share from that layer's W, summed by
autograd's accumulation as one backward would. Split layers (``tensor``) compose: a
tensor group's collectives sit inside autograd functions (``tensor/mappings``), so B runs
the input side's all-reduces and W, where a weight lies below one (a layer norm before a
colwise layer), runs that all-reduce again on the same values; every member runs the same
B and W in the same order. So does recompute, per layer (``LayerTape.run``): the forward
runs three times instead of two, for each layer's input held from F to W instead of its
saved tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from paratrain.parallel.pipeline.structure import flatten, floating, unflatten
from paratrain.parallel.pipeline.weight_units import (
    Unit,
    UnitHooks,
    UnitRecorder,
    overlapping,
    param_owners,
    units_of,
)


def graph_leaves(value: Any) -> list[torch.Tensor]:
    """The floating-point tensors of ``value`` that carry a graph (need a gradient), in the
    order stage-boundary messages use (a received value's: those whose gradients go back)."""
    leaves, _ = flatten(value)
    return [leaves[i] for i in floating(leaves) if leaves[i].requires_grad]


def _cut(value: Any) -> tuple[Any, list[torch.Tensor]]:
    """``value`` with its graph-carrying tensors replaced by detached copies that require
    grad (the next layer's inputs), and those copies, in ``graph_leaves`` order."""
    leaves, spec = flatten(value)
    cut, fresh = list(leaves), []
    for index in floating(leaves):
        if leaves[index].requires_grad:
            cut[index] = leaves[index].detach().requires_grad_(True)
            fresh.append(cut[index])
    return unflatten(spec, cut), fresh


def _call(layer: nn.Module, args: tuple, kwargs: dict, recompute: bool) -> Any:
    if recompute:
        return checkpoint(layer, *args, use_reentrant=False, **kwargs)
    return layer(*args, **kwargs)


@dataclass
class _Layer:
    inputs: list[torch.Tensor]
    """The layer's inputs that need a gradient (cut from the layer below; the chunk's own
    for an uncut chunk's one record)."""
    outputs: list[torch.Tensor]
    """Its outputs that carry a graph."""
    params: list[nn.Parameter]
    """Its trainable parameters."""
    grads: list[torch.Tensor] = field(default_factory=list)
    """The gradient B saw reach each output, kept for W (whole-layer W only)."""
    units: list[Unit] | None = None
    """The modules W takes one by one (``weight_units``), or None for a whole-layer W."""
    keep_graph: bool = False
    """Whether a unit's W must leave the graph for another's (nested units)."""


Owners = dict[nn.Module, list[nn.Parameter]]
"""Each module owning trainable parameters directly, and those parameters."""


class ChunkOwners:
    """What ``LayerTape`` needs of a chunk's modules, found once for a round of the
    schedule rather than on each forward (a walk of every module, 0.1-0.3 ms a
    micro-batch): the parameter owners of the whole chunk and of each layer, their
    parameters, and one forward hook on every owner while the round runs (``UnitHooks``).
    Built anew each round, so a parameter frozen between steps is seen."""

    def __init__(
        self,
        owners: Owners | None,
        params: list[nn.Parameter],
        layer_owners: list[Owners | None] | None = None,
        layer_params: list[list[nn.Parameter]] | None = None,
    ) -> None:
        self.owners = owners
        """The whole chunk's owners, None if a parameter has two (see ``param_owners``)."""
        self.params = params
        self.layer_owners = layer_owners or []
        """Each layer's, for a chunk cut between layers (none for a piece of a model cut
        at named split points, which runs uncut)."""
        self.layer_params = layer_params or []
        modules = dict.fromkeys(self.owners or {})
        for owners in self.layer_owners:
            modules.update(dict.fromkeys(owners or {}))
        self.hooks = UnitHooks(list(modules))

    @classmethod
    def of_layers(cls, layers: nn.Module | list[nn.Module]) -> ChunkOwners:
        """A chunk of a layer list (``nn.Sequential`` or a list of its layers)."""
        container = layers if isinstance(layers, nn.Module) else nn.ModuleList(layers)
        return cls(
            param_owners(container),
            [p for p in container.parameters() if p.requires_grad],
            [param_owners(layer) for layer in layers],
            [[p for p in layer.parameters() if p.requires_grad] for layer in layers],
        )

    def __enter__(self) -> ChunkOwners:
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.hooks.__exit__(*exc)

    def record(self, owners: dict[nn.Module, list[nn.Parameter]], call, *args, **kwargs):
        """``call(*args, **kwargs)`` with the calls of ``owners`` recorded; returns its
        value and the recorder."""
        recorder = UnitRecorder(owners)
        self.hooks.recorder = recorder
        try:
            value = call(*args, **kwargs)
        finally:
            self.hooks.recorder = None
        return value, recorder


class LayerTape:
    """One micro-batch's forward through one chunk, layer by layer, ready for B then W."""

    def __init__(self, *, whole: bool = False, owners: ChunkOwners | None = None) -> None:
        self.layers: list[_Layer] = []
        self.whole = whole
        """Run the chunk uncut, as one piece W takes unit by unit; after ``run``, whether
        that held (False where it was not tried or the graph did not prove it)."""
        self.owners = owners
        """The chunk's owners with their hooks in place (the engine's, for the round);
        None: found, and hooked, for this run alone."""

    def run(
        self,
        layers: nn.Sequential | list[nn.Module],
        args: tuple,
        kwargs: dict,
        *,
        recompute: bool = False,
    ) -> Any:
        """Call the layers as ``nn.Sequential`` would (the first on ``args``/``kwargs``,
        each next on the previous one's output). With ``whole`` and no recompute, uncut,
        the chunk one piece: B is then one backward to the input (none on a first stage,
        fed data) and to every unit's outputs; a chunk whose graph fails the proof gets a
        whole-chunk W this once (exact, B's work again) and ``whole`` False, so that the
        engine cuts it from then on. Otherwise the graph is cut between layers. A chunk
        whose inputs need no gradient is run plainly, its backward left whole to W. With
        ``recompute`` each layer keeps only its input and runs again in B and again in W
        (torch's checkpoint restores the random state, so dropout draws alike)."""
        if self.owners is not None:
            return self._run(self.owners, layers, args, kwargs, recompute)
        with ChunkOwners.of_layers(layers) as owners:
            return self._run(owners, layers, args, kwargs, recompute)

    def _run(self, chunk: ChunkOwners, layers, args, kwargs, recompute: bool) -> Any:
        inputs = [leaf for value in (*args, *kwargs.values()) for leaf in graph_leaves(value)]
        if not inputs:
            return self._run_deferred(chunk, layers, args, kwargs, recompute)
        if self.whole and not recompute and chunk.owners:
            return self._run_whole(chunk, layers, inputs, args, kwargs)
        self.whole = False
        value = None
        for index, layer in enumerate(layers):
            if index:
                value, inputs = _cut(value)
                args, kwargs = (value,), {}
            owners = None if recompute or not inputs else chunk.layer_owners[index]
            units = None
            if owners:
                value, recorder = chunk.record(owners, layer, *args, **kwargs)
                units = units_of(recorder, graph_leaves(value))
            else:
                value = _call(layer, args, kwargs, recompute)
            record = _Layer(inputs, graph_leaves(value), chunk.layer_params[index], units=units)
            record.keep_graph = units is not None and overlapping(units)
            self.layers.append(record)
        return value

    def run_piece(
        self,
        call: Callable[[], Any],
        inputs: list[torch.Tensor],
        leaves_of: Callable[[Any], list[torch.Tensor]],
    ) -> Any:
        """A piece that is no list of layers (a model's own forward between named split
        points; ``call`` runs it, with ``owners`` hooked): one uncut record. ``inputs``: the
        received tensors that need a gradient, in message order; none (fed data): its W is
        the piece's one whole backward, as on a layer list's first stage. Otherwise its
        units are recorded and proved as an uncut chunk's; a graph that fails the proof
        takes this micro-batch's W whole from the piece's output (exact, B's work again),
        and the next micro-batch is proved afresh (there are no layers to cut between).
        ``leaves_of``: the graph-carrying tensors of the piece's output (a model's output
        may hold objects the pipeline's messages never carry, such as a key-value cache)."""
        chunk = self.owners
        if chunk is None:
            raise ValueError("run_piece needs the piece's owners (LayerTape(owners=...)).")
        units = None
        if inputs and chunk.owners:
            value, recorder = chunk.record(chunk.owners, call)
            units = units_of(recorder, leaves_of(value))
        else:
            value = call()
        record = _Layer(inputs, leaves_of(value), chunk.params, units=units)
        record.keep_graph = units is not None and overlapping(units)
        self.layers = [record]
        if inputs:  # a deferred piece proves nothing and fails nothing
            self.whole = units is not None
        return value

    def _run_deferred(self, chunk: ChunkOwners, layers, args, kwargs, recompute: bool) -> Any:
        """A chunk whose inputs need no gradient (the first, fed data): B has nothing to
        send back, so it does nothing and W is the chunk's one whole backward, as torch's
        zero-bubble stages do on their first stage. Nothing to prove, no units; with
        recompute each layer runs again once, in W."""
        value = None
        for index, layer in enumerate(layers):
            if index:
                args, kwargs = (value,), {}
            value = _call(layer, args, kwargs, recompute)
        self.layers = [_Layer([], graph_leaves(value), chunk.params)]
        return value

    def _run_whole(self, chunk: ChunkOwners, layers, inputs, args, kwargs) -> Any:
        """The chunk uncut, its units recorded; one record whose W is per unit if the
        graph proves it, else the whole chunk's from its output (``whole`` then False)."""

        def forward() -> Any:
            value = None
            for index, layer in enumerate(layers):
                value = layer(*args, **kwargs) if index == 0 else layer(value)
            return value

        value, recorder = chunk.record(chunk.owners, forward)
        outputs = graph_leaves(value)
        units = units_of(recorder, outputs)
        record = _Layer(inputs, outputs, chunk.params, units=units)
        record.keep_graph = units is not None and overlapping(units)
        self.layers = [record]
        self.whole = units is not None
        return value

    @property
    def outputs(self) -> list[torch.Tensor]:
        """The chunk's outputs that carry a graph (its top layer's), in message order."""
        return self.layers[-1].outputs

    def backward_input(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """B: from the gradients of the chunk's ``outputs``, the gradients of its first
        layer's inputs, in their order."""
        for layer in reversed(self.layers):
            layer.grads = list(grads)
            grads = self._input_grads(layer)
            if not layer.params:
                layer.grads = []  # no W to keep them for
        return grads

    def backward_input_from_loss(self, loss: torch.Tensor) -> list[torch.Tensor]:
        """B of the last chunk, whose loss follows its top layer."""
        found = torch.autograd.grad(loss, self.outputs, retain_graph=True, allow_unused=True)
        grads = [
            torch.zeros_like(o) if g is None else g
            for o, g in zip(self.outputs, found, strict=True)
        ]
        return self.backward_input(grads)

    @staticmethod
    def _input_grads(layer: _Layer) -> list[torch.Tensor]:
        if not layer.outputs:
            return [torch.zeros_like(i) for i in layer.inputs]
        if layer.units is not None:  # B also makes the units' output gradients for W
            return LayerTape._input_and_unit_grads(layer)
        if not layer.inputs:
            return []
        found = torch.autograd.grad(
            layer.outputs,
            layer.inputs,
            layer.grads,
            retain_graph=bool(layer.params),  # W will walk this layer's graph again
            allow_unused=True,
        )
        return [
            torch.zeros_like(i) if g is None else g
            for i, g in zip(layer.inputs, found, strict=True)
        ]

    @staticmethod
    def _input_and_unit_grads(layer: _Layer) -> list[torch.Tensor]:
        """B of a layer W takes unit by unit: the inputs' gradients, and each unit's
        outputs' gradients kept on the unit (the layer's output gradient is then let go).
        A layer has units only where it has inputs that need a gradient (``_run``,
        ``run_piece``), so the call always has something to differentiate."""
        wanted = [out for unit in layer.units for out in unit.outputs]
        found = torch.autograd.grad(
            layer.outputs,
            [*layer.inputs, *wanted],
            layer.grads,
            retain_graph=bool(wanted),
            allow_unused=True,
        )
        rest = iter(found[len(layer.inputs) :])
        for unit in layer.units:
            unit.grads = [next(rest) for _ in unit.outputs]
        layer.grads = []
        return [
            torch.zeros_like(i) if g is None else g
            for i, g in zip(layer.inputs, found, strict=False)
        ]

    def backward_weight(self) -> None:
        """W: each layer's weight gradients, from its units' outputs or from its output
        gradient, accumulated into ``.grad``; the tape's graph is freed."""
        for layer in self.layers:
            if layer.units is not None:
                for unit in layer.units:
                    unit.backward_weight(keep_graph=layer.keep_graph)
            elif layer.params and layer.outputs:
                torch.autograd.backward(layer.outputs, layer.grads, inputs=layer.params)
        self.layers = []
