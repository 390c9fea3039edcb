"""Engine code that runs as written even where it is called from inside a graph that
``torch.compile`` traces.

Why: the engines hook into the user's model (ZeRO-3 gathers each unit's parameters in a
forward pre-hook; tensor parallelism's layers all-reduce inside autograd functions). In a
model compiled whole, dynamo traces those calls too, as far as the collective (where it
breaks the graph), and guards the graph on the Python state it read on the way: the
hang detector's count of collectives, the ledger's set of excluded storages, which change
every step. Every step then failed its guards and recompiled, until dynamo's limit of 8
recompilations, after which that code ran uncompiled for good (a gpt under tp, a zero3
mlp: 8 recompilations of one frame in 10 steps). ``untraced`` makes dynamo skip the
function, a graph break at its call as the collective made anyway, and nothing of it in
the guards.

``torch._disable_dynamo`` (what ``torch.optim`` wraps its methods with) imports dynamo at
the first call, not here: a process that never compiles pays nothing more than the first
optimizer it makes already paid.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

Function = TypeVar("Function", bound=Callable)


def untraced(fn: Function) -> Function:
    """``fn``, skipped by dynamo wherever it is called (see the module docstring)."""
    return torch._disable_dynamo(fn)
