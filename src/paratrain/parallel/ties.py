"""Tied weights: one tensor that a model's state dict holds under several names.

The usual case is a language model whose output head shares the input embedding's
Parameter (``model.lm_head.weight = model.wte.weight``). ``model.parameters()`` and
``named_parameters()`` give such a Parameter once, under the first name met in module
order; ``state_dict()`` gives it under every name. paratrain uses that first name as the
canonical one everywhere a name keys state (optimizer state, flat ZeRO units, checkpoint
files) and records the others as aliases of it: a checkpoint stores the tensor once and
lists the aliases in its manifest (``paratrain.checkpoints.format``).
"""

from __future__ import annotations

from torch import nn


def tied_names(module: nn.Module) -> dict[str, str]:
    """``{alias: canonical}`` for each state-dict tensor the module holds under several names.

    The canonical name is the one ``named_parameters()`` (or ``named_buffers()``) gives,
    the first in module order; every later name of the same tensor is an alias. Names
    outside the state dict (non-persistent buffers) are left out.
    """
    keys = set(module.state_dict(keep_vars=True))
    aliases: dict[str, str] = {}
    for named in (
        module.named_parameters(remove_duplicate=False),
        module.named_buffers(remove_duplicate=False),
    ):
        first: dict[int, str] = {}
        for name, tensor in named:
            if id(tensor) not in first:
                first[id(tensor)] = name
            elif name in keys and first[id(tensor)] in keys:
                aliases[name] = first[id(tensor)]
    return aliases
