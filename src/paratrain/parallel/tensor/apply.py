"""Swap a checked plan's modules for their split versions, in place, keeping every name.

Returns each split parameter's ``ShardSpec`` under its model name, which is all that the
state dict, checkpoints and optimizer state need to cut and rejoin it.
"""

from __future__ import annotations

from torch import nn
from torch.distributed import ProcessGroup

from paratrain.parallel.tensor.heads import split_attention
from paratrain.parallel.tensor.layers import ColwiseLinear, RowwiseLinear, VocabEmbedding
from paratrain.parallel.tensor.plan import COLWISE, ROWWISE, VOCAB, TensorPlan
from paratrain.parallel.tensor.shards import ShardSpec

_LAYERS = {COLWISE: ColwiseLinear, ROWWISE: RowwiseLinear, VOCAB: VocabEmbedding}


def apply_plan(
    model: nn.Module, plan: TensorPlan, *, rank: int, tensor: int, group: ProcessGroup | None
) -> dict[str, ShardSpec]:
    """Split ``model``'s planned modules; returns ``{parameter name: ShardSpec}``."""
    replacements = {name: split_attention for name in plan.attention}
    replacements.update({name: _LAYERS[kind] for name, kind in plan.splits.items()})
    for name, layer in replacements.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, layer(getattr(parent, child), rank=rank, tensor=tensor, group=group))
    specs: dict[str, ShardSpec] = {}
    for name, module in model.named_modules():
        for local, spec in getattr(module, "shard_specs", {}).items():
            specs[f"{name}.{local}" if name else local] = spec
    return specs
