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
from paratrain.parallel.live_cost import (
    backward_peak,
    collective_lag,
    reduce_scatter_staging,
    step_temporaries,
    with_transient,
)
from paratrain.parallel.replica_cost import activations, compute_seconds, tensor_seconds
from paratrain.parallel.zero.unit_sizes import units_by_layer
from paratrain.parallel.zero.units import UNITS

MiB = 1 << 20


def units(costs: ModelCosts, stage: int, bucket_mb: float) -> int:
    if stage == 3:
        return max(1, sum(1 for layer in costs.layers if layer.param_bytes))
    return max(1, math.ceil(costs.param_bytes() / (bucket_mb * MiB)))


def stage3_units(costs: ModelCosts, options: dict[str, Any]) -> tuple[int, float]:
    """zero3's units as the engine picks them (``unit_sizes``), and the root's bytes:
    what its collectives are counted by. Counted as a layer list's layers, a model that is
    no layer list was one unit: Hugging Face GPT-2 (2 blocks and the root, 5 gathers and
    3 reduce-scatters a step) was predicted 3 collectives and ran at twice its step."""
    by_layer, root = units_by_layer(costs, options.get(UNITS.name))
    return sum(len(sizes) for sizes in by_layer), root


def live_moments(
    costs: ModelCosts,
    run: Run,
    samples: float,
    options: dict[str, Any],
    *,
    stage: int,
    replicas: int,
    backend: str,
) -> tuple[float, ...]:
    """A ZeRO worker's live totals (``live_cost``) in backward, at the gradients'
    reduce-scatter and in the optimizer step.

    Stage 1 keeps full gradients in flat buffers. Stages 2-3 make each unit's gradients
    whole, flatten them into one more buffer of the unit's size for the reduce-scatter
    (``zero/grads``), then keep the slice: a stage-2 unit is a bucket, by default the
    whole of a small model, so its flattening holds the model's gradients twice. Each
    reduce-scatter may stage a copy of its input (``reduce_scatter_staging``). Stage 3
    also holds the unit being computed gathered whole (``zero/gather``: one at a time).
    The optimizer steps each unit's flat slice: its temporaries are at the largest one."""
    params, shard = costs.param_bytes(), 1.0 / replicas
    held = (params * shard if stage == 3 else params) + costs.frozen_bytes()
    base = held + costs.optimizer.state_bytes(
        costs.elements() * shard, units(costs, stage, options.get("bucket_mb", 25.0))
    )
    recompute = bool(options.get("recompute"))
    kept = stage == 1 or run.gradient_accumulation > 1
    grads = params if stage == 1 else params * shard
    backward = (
        base
        + (params if kept else 0.0)
        + backward_peak(
            costs,
            samples,
            batch_samples=run.global_batch,
            recompute=recompute,
            grads_kept=kept,
            kept_share=1.0 if stage == 1 else shard,
            **(unit_moments(costs, options, shard, backend) if stage == 3 else {}),
        )
    )
    bucket = min(params, options.get("bucket_mb", 25.0) * MiB)
    staging = reduce_scatter_staging(backend, bucket)
    # stage 1: full gradients kept, the staged copy and the slice; stage 2: a unit's
    # gradients and their flat copy, then (the gradients dropped) the flat, the staged
    # copy and the slice
    scattering = staging + bucket * shard
    reduce = base + params + (max(bucket, scattering) if stage == 2 else scattering)
    unit_elements = (
        max((layer.param_elements for layer in costs.layers), default=0)
        if stage == 3
        else bucket / max(1, params) * costs.elements()
    )
    step = base + grads + step_temporaries(costs, unit_elements * shard, fused=True)
    if stage == 3:  # the root and the unit in use during forward, with everything
        # forward saved; its reduce-scatters are each unit's, in backward
        by_layer, root = units_by_layer(costs, options.get(UNITS.name))
        widest = root + max((size for sizes in by_layer for size in sizes), default=0.0)
        forward = base + widest + activations(costs, run, samples, recompute)
        return backward, step, forward
    return backward, reduce, step


def unit_moments(
    costs: ModelCosts, options: dict[str, Any], shard: float, backend: str
) -> dict[str, list[float]]:
    """Stage 3's bytes beyond a layer's own backward (``backward_peak``'s ``gathered``
    and ``scattered``), from its units (``unit_sizes``): while a unit computes its
    backward it is gathered whole, and the unit reduced before it (the next in module
    order) still has its flat gradients in flight (``grads``: each launch waits for the
    previous message first, so one at a time); the root is gathered throughout. When a
    unit's gradients are done they and their flat copy are alive together, then the flat
    copy, the backend's staged copy and the slice."""
    by_layer, root = units_by_layer(costs, options.get(UNITS.name))
    flat = [size for sizes in by_layer for size in sizes]
    factor = max(2.0, 1.0 + reduce_scatter_staging(backend, 1.0) + shard)
    gathered, scattered, seen = [], [], 0
    for sizes in by_layer:
        after = flat[seen + len(sizes)] if seen + len(sizes) < len(flat) else 0.0
        pairs = [
            size + (flat[seen + j + 1] if seen + j + 1 < len(flat) else 0.0)
            for j, size in enumerate(sizes)
        ]
        gathered.append(root + max(pairs, default=after))
        scattered.append(root + factor * max(sizes, default=0.0))
        seen += len(sizes)
    return {"gathered": gathered, "scattered": scattered}


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
    moments = live_moments(
        costs, run, samples, options, stage=stage, replicas=replicas, backend=machine.backend
    )
    memory = with_transient(memory, moments=moments, lag=collective_lag(costs, samples))
    workers = replicas * costs.tensor
    one = compute_seconds(costs, samples, accumulation, recompute)
    one += costs.optimizer.step_s_per_element * costs.elements() * shard
    compute = machine.compute_seconds(workers * one, one)
    communication = tensor_seconds(costs, machine, samples, accumulation)
    if stage == 3:
        unit_count, root = stage3_units(costs, options)
        held = 1 if root > 0 else 0
        communication += machine.reduce_scatter_s(params, replicas, messages=unit_count + held)
        # each unit gathered for forward and again for backward, the root once, per
        # micro-batch
        communication += machine.all_gather_s(
            accumulation * (2 * (params - root) + root),
            replicas,
            messages=accumulation * (2 * unit_count + held),
        )
    else:  # the updated slices back into every replica's parameters
        count = units(costs, stage, options.get("bucket_mb", 25.0))
        communication += machine.reduce_scatter_s(params, replicas, messages=count)
        communication += machine.all_gather_s(params, replicas, messages=count)
    return Prediction.of(
        memory, compute_s=compute, communication_s=communication, workers=workers, machine=machine
    )
