"""Swap a checked plan's modules for their split versions, in place, keeping every name.

Returns each split parameter's ``ShardSpec`` under its model name, which is all that the
state dict, checkpoints and optimizer state need to cut and rejoin it. A parameter tied
across "vocab" modules (an embedding and its lm head) is cut once: the modules that held
one whole tensor hold one slice.
"""

from __future__ import annotations

from torch import nn
from torch.distributed import ProcessGroup

from paratrain.parallel.tensor.heads import split_attention
from paratrain.parallel.tensor.layers import (
    ColwiseLinear,
    RowwiseLinear,
    VocabEmbedding,
    VocabHead,
)
from paratrain.parallel.tensor.plan import COLWISE, ROWWISE, VOCAB, TensorPlan
from paratrain.parallel.tensor.shards import ShardSpec

_LAYERS = {COLWISE: ColwiseLinear, ROWWISE: RowwiseLinear, VOCAB: VocabEmbedding}


def _layer(kind: str, module: nn.Module):
    """The split class for ``kind``: a "vocab" Linear is an lm head."""
    return VocabHead if kind == VOCAB and isinstance(module, nn.Linear) else _LAYERS[kind]


def _retie(model: nn.Module, tied: dict[str, int]) -> None:
    """Point every "vocab" module whose weight was one tensor at one slice again."""
    first: dict[int, nn.Parameter] = {}
    for name, key in tied.items():
        module = model.get_submodule(name)
        module.weight = first.setdefault(key, module.weight)


def apply_plan(
    model: nn.Module, plan: TensorPlan, *, rank: int, tensor: int, group: ProcessGroup | None
) -> dict[str, ShardSpec]:
    """Split ``model``'s planned modules; returns ``{parameter name: ShardSpec}``."""
    replacements = {name: split_attention for name in plan.attention}
    modules = dict(model.named_modules())
    replacements.update({name: _layer(kind, modules[name]) for name, kind in plan.splits.items()})
    tied = {name: id(modules[name].weight) for name, kind in plan.splits.items() if kind == VOCAB}
    for name, layer in replacements.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, layer(getattr(parent, child), rank=rank, tensor=tensor, group=group))
    _retie(model, tied)
    specs: dict[str, ShardSpec] = {}
    for name, module in model.named_modules():
        for local, spec in getattr(module, "shard_specs", {}).items():
            specs[f"{name}.{local}" if name else local] = spec
    return specs
