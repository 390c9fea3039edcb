"""ZeRO's arithmetic for the planner: one worker's ledger and step time from measured costs.

As dp (``dp/cost``) but with the model state sharded over the replicas (of this worker's
tensor rank, for zero1/2 with ``tensor``): the optimizer state 1/replicas (zero1), the
gradients too (zero2), the parameters too (zero3, whose gathered units the ledger leaves
out). Stage 1's gradients live in flat buffers for the whole run, so they are there
during forward; stages 2-3 drop their slices at each step's start (``grads.zero_grad``).
The optimizer holds one flat slice per unit: its per-tensor state (Adam's step) is
counted per unit, a unit being a ``bucket_mb`` bucket (zero1/2) or a layer with
parameters (zero3, by default a layer list's layers).

Communication: a reduce-scatter and an all-gather (one all-reduce's traffic) of the
gradients per step; zero3 also gathers every unit once for forward and once for backward
in each micro-batch (an all-gather moves what half an all-reduce does).
"""

from __future__ import annotations

import math
from typing import Any

from paratrain.parallel.cost_model import MachineCosts, ModelCosts, Prediction, Run, ledger_at_peak
from paratrain.parallel.replica_cost import activations, compute_seconds, tensor_seconds

MiB = 1 << 20


def units(costs: ModelCosts, stage: int, bucket_mb: float) -> int:
    if stage == 3:
        return max(1, sum(1 for layer in costs.layers if layer.param_bytes))
    return max(1, math.ceil(costs.param_bytes() / (bucket_mb * MiB)))


def predict(
    costs: ModelCosts,
    machine: MachineCosts,
    run: Run,
    options: dict[str, Any],
    *,
    stage: int,
    replicas: int,
) -> Prediction:
    accumulation = run.gradient_accumulation
    samples = run.global_batch / (replicas * accumulation)
    recompute = bool(options.get("recompute"))
    params = costs.param_bytes()
    shard = 1.0 / replicas
    optimizer = costs.optimizer.state_bytes(
        costs.elements() * shard, units(costs, stage, options.get("bucket_mb", 25.0))
    )
    memory = ledger_at_peak(
        parameters=(params * shard if stage == 3 else params) + costs.frozen_bytes(),
        gradients=params * shard if stage >= 2 else params,
        optimizer=optimizer,
        activations=activations(costs, run, samples, recompute),
        gradients_persist=stage == 1,
    )
    workers = replicas * costs.tensor
    compute = machine.compute_share(workers) * (
        compute_seconds(costs, samples, accumulation, recompute)
        + costs.optimizer.step_s_per_element * costs.elements() * shard
    )
    communication = machine.all_reduce_s(params, replicas) + tensor_seconds(
        costs, machine, samples, accumulation
    )
    if stage == 3:
        gathers = 2 * accumulation * units(costs, stage, 0)
        communication += machine.all_reduce_s(accumulation * params, replicas, messages=gathers)
    return Prediction.of(
        memory, compute_s=compute, communication_s=communication, workers=workers, machine=machine
    )
