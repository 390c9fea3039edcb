"""``strategy="tp"``: tensor parallelism (Megatron-LM's), dp whose layers split over every
worker unless ``tensor`` says fewer.

Every worker holds its slice of each split layer and the whole of everything else
(LayerNorms, embeddings not split, rowwise biases), and runs forward and backward on its
replica's share of the global batch: the split layers' ``f``/``g`` operators make every
replicated activation, and so every replicated gradient, whole and equal on the members of
a tensor group, so nothing is all-reduced for them and nothing is counted twice. A
colwise/rowwise pair costs one all-reduce of its output forward and one of its input's
gradient backward. With ``tensor`` below the worker count the workers form ``replicas x
tensor`` (tensor innermost) and the replicas average gradients as dp does: this is dp's
engine, with the tensor degree's default the only difference (``parallel/tensor``).
"""

from __future__ import annotations

from typing import Any

from paratrain.parallel.cost_model import with_recompute
from paratrain.parallel.dp.engine import DataParallelEngine
from paratrain.parallel.registry import register


@register("tp")
class TensorParallelEngine(DataParallelEngine):
    """dp with ``tensor`` every worker by default (``tensor=1`` over several is refused:
    that is dp). Options as dp's, ``tp_plan`` included."""

    tensor_by_default = True
    default = False
    advice_rank = None  # its share depends on the plan: the advice suggests the others

    @classmethod
    def plan_layouts(cls, devices: int, *, layer_list: bool) -> list[dict[str, Any]]:
        """Every worker one tensor group (fewer are dp's layouts)."""
        return with_recompute([{}], layer_list) if devices > 1 else []
