"""A model compiled whole by ``torch.compile``, measured as its own module runs it.

Why: the planner measures a model by hooks at its layers' and blocks' calls (what each
saves, what a block receives) and by running a stage's piece of it alone. Inside a graph
that dynamo traces, those hooks are traced too: a block's recorded arguments were not
the tensors a stage sends, and ``paratrain.plan`` refused every pipeline of a model
compiled whole that it cuts at named blocks. Turning dynamo off while measuring is no
answer either: ``torch._dynamo.config.disable`` marks the code it skips as never to be
compiled again in that process, so the user's model would then train uncompiled.

``as_written`` gives the planner the compiled model's own module (``_orig_mod``) under the
same names, ``_orig_mod.`` included, inside a module that calls it directly: the layouts,
split points and names it prices are those of the model the engines are given, and its
times are the uncompiled model's (which the compiled model usually beats).
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn


class CompiledAsWritten(nn.Module):
    """The module a ``torch.compile`` wrapper holds, under the wrapper's names, called
    as written (no dynamo)."""

    def __init__(self, compiled: nn.Module) -> None:
        super().__init__()
        self._orig_mod = compiled._orig_mod

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._orig_mod(*args, **kwargs)


def compiled_whole(model: nn.Module) -> bool:
    """Whether ``model`` is ``torch.compile``'s wrapper (an ``OptimizedModule``). Dynamo
    is imported by whoever compiled it; a process that never did has no such model, and
    is spared the import."""
    dynamo = sys.modules.get("torch._dynamo")
    return dynamo is not None and isinstance(model, dynamo.eval_frame.OptimizedModule)


def as_written(model: nn.Module) -> nn.Module:
    """``model`` itself, or where it is compiled whole, its module as written under the
    same names (``CompiledAsWritten``)."""
    return CompiledAsWritten(model) if compiled_whole(model) else model
