"""``dp`` and ``tp`` described before any worker starts: options, layouts, costs.

dp replicates the model (its layers optionally split over ``tensor`` workers); tp is the
same engine with the tensor degree every worker by default, so ``tensor=1`` over several
workers is refused there (that is dp).
"""

from __future__ import annotations

from typing import Any

from paratrain.parallel import replica_cost
from paratrain.parallel.buffer_sync import BROADCAST_BUFFERS
from paratrain.parallel.cost_model import divisors, with_recompute
from paratrain.parallel.dp.engine import DataParallelEngine
from paratrain.parallel.dp.tp import TensorParallelEngine
from paratrain.parallel.grad_buckets import BUCKET_MB
from paratrain.parallel.recompute import RECOMPUTE
from paratrain.parallel.registry import register
from paratrain.parallel.replica_strategy import ReplicaStrategy
from paratrain.parallel.sync_batchnorm import SYNC_BATCHNORM
from paratrain.parallel.tensor.options import TENSOR


@register("dp")
class DataParallelStrategy(ReplicaStrategy):
    """Replicated model, sharded batch, gradients averaged by bucketed all-reduce (see
    ``DataParallelEngine`` for the options)."""

    engine = DataParallelEngine
    options = (BUCKET_MB, RECOMPUTE, BROADCAST_BUFFERS, SYNC_BATCHNORM, TENSOR)
    default = True  # the strategy most runs want: the model fits, the batch splits
    advice_rank = 0
    elastic = True  # every replica holds everything (without --tensor: see elastic_checks)

    @classmethod
    def plan_layouts(cls, devices: int, *, layer_list: bool) -> list[dict[str, Any]]:
        """Replicas alone, and replicas x tensor for each tensor degree short of every
        worker (that is ``tp``'s)."""
        if devices < 2:
            return []
        tensors = [t for t in divisors(devices) if t < devices]
        layouts = [{TENSOR.name: t} if t > 1 else {} for t in tensors]
        return with_recompute(layouts, layer_list)

    @classmethod
    def predict(cls, costs_for, machine, run, options):
        layout = cls.layout(run.devices, options)
        return replica_cost.predict(
            costs_for(layout.tensor), machine, run, options, layout.replicas
        )


@register("tp")
class TensorParallelStrategy(DataParallelStrategy):
    """dp with ``tensor`` every worker by default (``tensor=1`` over several is refused:
    that is dp). Options as dp's, ``tp_plan`` included."""

    engine = TensorParallelEngine
    tensor_by_default = True
    default = False
    elastic = False  # each worker holds a slice of the split layers only
    advice_rank = None  # its share depends on the plan: the advice suggests the others

    @classmethod
    def plan_layouts(cls, devices: int, *, layer_list: bool) -> list[dict[str, Any]]:
        """Every worker one tensor group (fewer are dp's layouts)."""
        return with_recompute([{}], layer_list) if devices > 1 else []
