"""Which pairs of a module's own Linears are joined by elementwise ops only.

A colwise layer leaves each rank a slice of the features; that is only correct if what
follows until the rowwise layer acts on each feature alone (an activation, dropout, a
scale). We trace the module's own forward one level deep (every child a leaf, with
``torch.fx``) and follow each Linear's output through such ops to the next Linear. A
module that does not trace (data-dependent control flow) yields None: nothing is found
there, and a plan naming its children cannot be checked against its forward.
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


class _OneLevel(fx.Tracer):
    """Traces a module's own forward: every submodule call stays one node."""

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return True


def _only_source(node: fx.Node, source: fx.Node) -> bool:
    """Whether ``source`` is ``node``'s one tensor argument (the rest constants)."""
    values = [*node.args, *node.kwargs.values()]
    nodes = [value for value in values if isinstance(value, fx.Node)]
    return nodes == [source] and all(
        isinstance(v, (int, float, bool, str, type(None), fx.Node)) for v in values
    )


def _elementwise(node: fx.Node, source: fx.Node, root: nn.Module) -> bool:
    if not _only_source(node, source):
        return False
    if node.op == "call_module":
        return isinstance(root.get_submodule(node.target), ELEMENTWISE_MODULES)
    if node.op == "call_function":
        return node.target in ELEMENTWISE_FUNCTIONS or node.target in SCALAR_OPERATORS
    if node.op == "call_method":
        return node.target in ELEMENTWISE_METHODS
    return False


def elementwise_pairs(module: nn.Module) -> list[tuple[str, str]] | None:
    """(first, second) child names: the first Linear's output reaches the second Linear's
    input through elementwise ops alone and goes nowhere else; None if no trace."""
    try:
        graph = _OneLevel().trace(module)
    except Exception:  # any tracing failure means: cannot tell
        return None
    linears = {name for name, child in module.named_children() if isinstance(child, nn.Linear)}
    calls = Counter(node.target for node in graph.nodes if node.op == "call_module")
    pairs: list[tuple[str, str]] = []
    paired: set[str] = set()
    for node in graph.nodes:
        if node.op != "call_module" or node.target not in linears or node.target in paired:
            continue
        current = node
        while len(current.users) == 1:
            following = next(iter(current.users))
            if following.op == "call_module" and following.target in linears:
                if (
                    calls[node.target] == 1
                    and calls[following.target] == 1
                    and following.target not in paired
                    and following.args == (current,)
                    and not following.kwargs
                ):
                    pairs.append((node.target, following.target))
                    paired.update((node.target, following.target))
                break
            if not _elementwise(following, current, module):
                break
            current = following
    return pairs
