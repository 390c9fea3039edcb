"""Which of a module's own Linears feed which through elementwise ops only.

A colwise layer leaves each rank a slice of the features; that is only correct if what
follows until the rowwise layer acts on each feature alone (an activation, dropout, a
scale) or joins two such slices feature by feature (SwiGLU's ``act(gate(x)) * up(x)``).
We trace the module's own forward one level deep (every child a leaf, with ``torch.fx``)
and follow each Linear's output through such ops to the next Linear. A module that does
not trace (data-dependent control flow, Hugging Face attention) yields None: nothing is
found there, and a plan naming its children cannot be checked against its forward, so
``plan`` refuses it (unless it is an attention whose shape ``heads`` knows).

GPT-2's ``Conv1D`` (a Linear whose weight is stored transposed) counts as a Linear.
"""

from __future__ import annotations

import operator
from collections import Counter

import torch
import torch.nn.functional as F
from torch import fx, nn

ELEMENTWISE_MODULES = (
    nn.ReLU,
    nn.GELU,
    nn.SiLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.LeakyReLU,
    nn.ELU,
    nn.Mish,
    nn.Softplus,
    nn.Hardswish,
    nn.Dropout,
    nn.Identity,
)
ELEMENTWISE_FUNCTIONS = {
    F.relu,
    F.gelu,
    F.silu,
    F.leaky_relu,
    F.elu,
    F.mish,
    F.dropout,
    torch.relu,
    torch.tanh,
    torch.sigmoid,
    F.sigmoid,
    F.tanh,
}
ELEMENTWISE_METHODS = {"relu", "gelu", "tanh", "sigmoid", "contiguous"}
SCALAR_OPERATORS = {operator.mul, operator.truediv, operator.add, operator.sub, torch.mul}
"""Elementwise with a constant, or between two slices of the same features."""
ACTIVATION_MODULE = "transformers.activations"
"""Hugging Face's activation classes (``ACT2FN``): every one of them is elementwise."""


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is GPT-2's ``Conv1D``: ``x @ weight + bias``, weight (in, out)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def is_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` or a ``Conv1D``: what colwise and rowwise split."""
    return isinstance(module, nn.Linear) or is_conv1d(module)


def out_width(module: nn.Module) -> int:
    return module.nf if is_conv1d(module) else module.out_features


def in_width(module: nn.Module) -> int:
    return module.nx if is_conv1d(module) else module.in_features


class _OneLevel(fx.Tracer):
    """Traces a module's own forward: every submodule call stays one node."""

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return True


def _tensor_args(node: fx.Node) -> list[fx.Node] | None:
    """``node``'s tensor arguments, or None if any other argument is not a constant."""
    values = [*node.args, *node.kwargs.values()]
    if not all(isinstance(v, (int, float, bool, str, type(None), fx.Node)) for v in values):
        return None
    return [value for value in values if isinstance(value, fx.Node)]


def _elementwise(node: fx.Node, root: nn.Module) -> bool:
    """Whether ``node`` acts on each feature alone (its tensor arguments feature-aligned)."""
    if node.op == "call_module":
        module = root.get_submodule(node.target)
        return isinstance(module, ELEMENTWISE_MODULES) or (
            type(module).__module__ == ACTIVATION_MODULE
        )
    if node.op == "call_function":
        return node.target in ELEMENTWISE_FUNCTIONS or node.target in SCALAR_OPERATORS
    return node.op == "call_method" and node.target in ELEMENTWISE_METHODS


def _sliced_sources(graph: fx.Graph, root: nn.Module, linears: set[str]) -> dict:
    """Each node that is an elementwise function of Linear outputs alone -> those Linears."""
    sources: dict[fx.Node, frozenset[str]] = {}
    for node in graph.nodes:
        if node.op == "call_module" and node.target in linears:
            sources[node] = frozenset([node.target])
            continue
        inputs = _tensor_args(node)
        if not inputs or not _elementwise(node, root) or len(inputs) > 2:
            continue
        if len(inputs) == 2 and node.target not in SCALAR_OPERATORS:
            continue
        if all(source in sources for source in inputs):
            sources[node] = frozenset().union(*(sources[source] for source in inputs))
    return sources


def _stays_inside(start: fx.Node, sources: dict, end: fx.Node) -> bool:
    """Whether every value between the Linears feeding ``start`` and ``start`` itself is
    used only on the way to ``end`` (a slice escaping elsewhere would be wrong)."""
    inside = {node for node, names in sources.items() if names <= sources[start]}
    ancestors, stack = set(), [start]
    while stack:
        node = stack.pop()
        if node in ancestors or node not in inside:
            continue
        ancestors.add(node)
        if node.op != "call_module" or node.target not in sources[node]:  # not a Linear
            stack.extend(arg for arg in _tensor_args(node) or [] if arg in inside)
    return all(user in ancestors or user is end for node in ancestors for user in node.users)


def feeding_groups(module: nn.Module) -> list[tuple[tuple[str, ...], str]] | None:
    """``(colwise children, rowwise child)``: the colwise Linears' outputs reach the
    rowwise Linear's input through elementwise ops alone and go nowhere else (one Linear
    for an MLP, two for a gated one); None if the module does not trace."""
    try:
        graph = _OneLevel().trace(module)
    except Exception:  # any tracing failure means: cannot tell
        return None
    linears = {name for name, child in module.named_children() if is_linear(child)}
    calls = Counter(node.target for node in graph.nodes if node.op == "call_module")
    sources = _sliced_sources(graph, module, linears)
    groups: list[tuple[tuple[str, ...], str]] = []
    used: set[str] = set()
    for node in graph.nodes:
        if node.op != "call_module" or node.target not in linears or node.kwargs:
            continue
        if len(node.args) != 1 or node.args[0] not in sources:
            continue
        feeding = sources[node.args[0]]
        members = {*feeding, node.target}
        if any(calls[name] != 1 for name in members) or members & used or node.target in feeding:
            continue
        if _stays_inside(node.args[0], sources, node):
            groups.append((tuple(sorted(feeding)), node.target))
            used.update(members)
    return groups
