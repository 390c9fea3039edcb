"""ZeRO's arithmetic for the planner: one worker's ledger and step time from measured costs.

As dp (``dp/cost``) but with the model state sharded over the replicas (of this worker's
tensor rank, for zero1/2 with ``tensor``): the optimizer state 1/replicas (zero1), the
gradients too (zero2), the parameters too (zero3, whose gathered units the ledger leaves
out). Stage 1's gradients live in flat buffers for the whole run, so they are there
during forward; stages 2-3 drop their slices at each step's start (``grads.zero_grad``).
The optimizer holds one flat slice per unit: its per-tensor state (Adam's step) is
counted per unit, a unit being a ``bucket_mb`` bucket (zero1/2) or a layer with
parameters (zero3, by default a layer list's layers).

Communication, as measured on this machine: a reduce-scatter of each unit's gradients and
an all-gather of its updated parameters per step; zero3 instead gathers every unit once
for forward and once for backward in each micro-batch, and reduce-scatters per step.
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
    one = compute_seconds(costs, samples, accumulation, recompute)
    one += costs.optimizer.step_s_per_element * costs.elements() * shard
    compute = machine.compute_seconds(workers * one, one)
    count = units(costs, stage, options.get("bucket_mb", 25.0))
    communication = machine.reduce_scatter_s(params, replicas, messages=count)
    communication += tensor_seconds(costs, machine, samples, accumulation)
    if stage == 3:  # each unit gathered for forward and for backward, per micro-batch
        gathers = 2 * accumulation
        communication += machine.all_gather_s(gathers * params, replicas, gathers * count)
    else:  # the updated slices back into every replica's parameters
        communication += machine.all_gather_s(params, replicas, messages=count)
    return Prediction.of(
        memory, compute_s=compute, communication_s=communication, workers=workers, machine=machine
    )
