"""zero1, zero2 and zero3 described before any worker starts: options, memory, costs.

Each stage shards one more part of the model state over the replicas (optimizer state,
then gradients, then parameters); their arithmetic here is what the out-of-memory advice
and the planner read, and ``cost.py`` holds the planner's time model.
"""

from __future__ import annotations

from typing import Any

from paratrain.parallel.buffer_sync import BROADCAST_BUFFERS
from paratrain.parallel.cost_model import divisors, with_recompute
from paratrain.parallel.grad_buckets import BUCKET_MB
from paratrain.parallel.layout import Layout
from paratrain.parallel.options import RunSpec, given
from paratrain.parallel.recompute import RECOMPUTE
from paratrain.parallel.registry import register
from paratrain.parallel.replica_strategy import ReplicaStrategy
from paratrain.parallel.sync_batchnorm import SYNC_BATCHNORM
from paratrain.parallel.tensor.options import TENSOR
from paratrain.parallel.zero import cost as zero_cost
from paratrain.parallel.zero.engine import Zero1Engine, Zero2Engine, Zero3Engine
from paratrain.parallel.zero.shard_copies import SHARD_COPIES
from paratrain.parallel.zero.units import UNITS, check_units


class _ReplicatedParametersStrategy(ReplicaStrategy):
    """Stages 1-2: the full parameters stay on every worker (of its tensor slices)."""

    stage: int
    options = (BUCKET_MB, RECOMPUTE, BROADCAST_BUFFERS, SYNC_BATCHNORM, TENSOR)

    @classmethod
    def plan_layouts(cls, devices: int, *, layer_list: bool) -> list[dict[str, Any]]:
        """Sharding over every worker, or over the replicas of each tensor degree."""
        if devices < 2:
            return []
        tensors = [t for t in divisors(devices) if t < devices]
        return with_recompute([{TENSOR.name: t} if t > 1 else {} for t in tensors], layer_list)

    @classmethod
    def predict(cls, costs_for, machine, run, options):
        layout = cls.layout(run.devices, options)
        return zero_cost.predict(
            costs_for(layout.tensor),
            machine,
            run,
            options,
            stage=cls.stage,
            replicas=layout.replicas,
        )


@register("zero1")
class Zero1Strategy(_ReplicatedParametersStrategy):
    """ZeRO stage 1: optimizer state sharded (see ``Zero1Engine`` for the options)."""

    engine = Zero1Engine
    stage = 1
    advice_rank = 1
    elastic_from_checkpoint = True  # its checkpoint loads at any count (test_elastic)

    @classmethod
    def model_state_per_worker(
        cls, parameters, workers, options, *, weight=4, gradient=4, optimizer=8
    ) -> float:
        """Weights and gradients whole, optimizer state 1/replicas (of a worker's share:
        split layers 1/tensor)."""
        replicas = cls.layout(workers, options).replicas
        share = cls.parameter_share(workers, options) * parameters
        return (weight + gradient + optimizer / replicas) * share


@register("zero2")
class Zero2Strategy(_ReplicatedParametersStrategy):
    """ZeRO stage 2: optimizer state and gradients sharded."""

    engine = Zero2Engine
    stage = 2
    advice_rank = 2
    elastic_from_checkpoint = True  # tested (test_elastic)
    options = (*_ReplicatedParametersStrategy.options, SHARD_COPIES)

    @classmethod
    def elastic_in_memory(cls, options: dict[str, Any]) -> bool:
        """With ``shard_copies`` every slice is on two workers (``shard_copies``)."""
        return bool(given(options, SHARD_COPIES))

    @classmethod
    def model_state_per_worker(
        cls, parameters, workers, options, *, weight=4, gradient=4, optimizer=8
    ) -> float:
        """Weights whole; gradients and optimizer state 1/replicas (of a worker's share);
        with ``shard_copies`` two more slices of weights and optimizer state (the
        neighbour's copy and the last one sent, see ``shard_copies``)."""
        replicas = cls.layout(workers, options).replicas
        share = cls.parameter_share(workers, options) * parameters
        copies = 2 * (weight + optimizer) if given(options, SHARD_COPIES) and replicas > 1 else 0
        return (weight + (gradient + optimizer + copies) / replicas) * share


@register("zero3")
class Zero3Strategy(ReplicaStrategy):
    """ZeRO stage 3: parameters, gradients and optimizer state all sharded (no tensor
    option: every worker is a replica)."""

    engine = Zero3Engine
    stage = 3
    options = (RECOMPUTE, BROADCAST_BUFFERS, SYNC_BATCHNORM, UNITS)
    advice_rank = 3
    elastic_from_checkpoint = True  # its checkpoint loads at any count (test_elastic)

    @classmethod
    def layout(cls, devices: int, options: dict[str, Any]) -> Layout:
        """Every worker a replica (the engine refuses a ``tensor`` keyword itself)."""
        return Layout.over(devices)

    @classmethod
    def check_run(cls, run: RunSpec) -> None:
        """The batch, then the ``units`` entries and ``recompute`` against a meta copy."""
        super().check_run(run)
        units = run.options.get(UNITS.name)
        if units is not None and run.build_model is not None:
            check_units(run.build_model(), units, given(run.options, RECOMPUTE))

    @classmethod
    def parameter_share(cls, workers: int, options: dict[str, Any]) -> float:
        return 1.0 / workers

    @classmethod
    def plan_layouts(cls, devices: int, *, layer_list: bool) -> list[dict[str, Any]]:
        return with_recompute([{}], layer_list) if devices > 1 else []

    @classmethod
    def predict(cls, costs_for, machine, run, options):
        return zero_cost.predict(costs_for(1), machine, run, options, stage=3, replicas=run.devices)

    @classmethod
    def model_state_per_worker(
        cls, parameters, workers, options, *, weight=4, gradient=4, optimizer=8
    ) -> float:
        """Everything 1/N (a gathered unit's transient full copy is not model state)."""
        return (weight + gradient + optimizer) / workers * parameters
