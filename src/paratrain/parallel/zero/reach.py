"""Which parameters a backward will reach, read off the autograd graph before it runs.

Why stage 3 needs it: its units' gradients are reduce-scattered in a fixed order as each
unit's last gradient arrives, while backward also gathers the earlier units' parameters.
A unit holding a parameter this replica's forward left out (a branch the data chooses
inside a block every replica runs) would never complete here, so this replica would hold
that unit's reduce-scatter, and every later one, until backward ends, while the replicas
that used the parameter wait in that reduce-scatter before they gather the next unit:
each waits for the other. Knowing up front which parameters backward cannot reach lets
the unit complete when its reachable gradients have arrived, as DDP does with
``find_unused_parameters=True`` (the same walk, from the outputs).

A reentrant ``torch.utils.checkpoint`` segment runs its forward without a graph and
replays it in backward, so the parameters inside it are not in the graph before backward;
the walk then answers ``None`` ("cannot tell") and the units complete as before.
"""

from __future__ import annotations

import torch

_OPAQUE = ("CheckpointFunctionBackward",)
"""Graph nodes whose backward builds and runs a graph of its own (reentrant checkpoint)."""


def reachable_leaves(root: torch.Tensor) -> set[int] | None:
    """The ids of the leaf tensors ``root.backward()`` would accumulate into, or None
    where the graph hides some (see the module docstring)."""
    found: set[int] = set()
    if root.grad_fn is None:
        return found
    seen: set[object] = set()
    stack = [root.grad_fn]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if type(node).__name__ in _OPAQUE:
            return None
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf
        if variable is not None:
            found.add(id(variable))
        stack.extend(child for child, _ in node.next_functions if child is not None)
    return found
