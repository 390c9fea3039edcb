"""A replica's arithmetic for the planner (single, dp and tp; ZeRO builds on it): one
worker's ledger and step time from measured costs.

A worker of ``replicas x tensor`` holds its slices of the split layers and everything else
whole (``costs`` measured at its tensor degree): parameters, their gradients (in the
all-reduce buckets, kept between steps, where there are replicas; set to None at each
step's start where there are none), the optimizer's state of them, the activations one
micro-batch of its share leaves saved (only the segment inputs under ``recompute``), and
the buckets' two extra slots (the loss, the count of unused parameters). A step is the
micro-batches' forward and backward (a recomputed forward more under ``recompute``), the
tensor group's all-reduces, the replicas' gradient all-reduce and the optimizer step.
"""

from __future__ import annotations

from typing import Any

from paratrain.parallel.cost_model import (
    MachineCosts,
    ModelCosts,
    Prediction,
    Run,
    ledger_at_peak,
)
from paratrain.parallel.live_cost import (
    backward_peak,
    collective_lag,
    step_temporaries,
    with_transient,
)

EXTRA_SLOT_BYTES = 8
"""The loss and the unused-parameter count riding in the last bucket (fp32 each)."""


def activations(costs: ModelCosts, run: Run, samples: float, recompute: bool) -> float:
    """What one micro-batch of ``samples`` leaves saved, the batch's tensors as views of
    the global batch (``ModelCosts.inputs_saved``)."""
    if recompute:
        return costs.recomputed_saved(samples, batch_samples=run.global_batch)
    return costs.saved(samples, batch_samples=run.global_batch)


def compute_seconds(costs: ModelCosts, samples: float, micro_batches: int, recompute: bool):
    """Forward and backward of every micro-batch (and the recomputed forwards)."""
    per_micro = costs.time(samples) + (costs.forward_time(samples) if recompute else 0.0)
    return micro_batches * per_micro


def tensor_seconds(costs: ModelCosts, machine: MachineCosts, samples: float, micro: int):
    """The tensor group's all-reduces of ``micro`` micro-batches."""
    return machine.all_reduce_s(
        micro * costs.tensor_bytes.at(samples),
        costs.tensor,
        messages=micro * costs.tensor_messages.at(samples),
    )


def live_moments(
    costs: ModelCosts,
    run: Run,
    samples: float,
    recompute: bool,
    replicas: int,
    gradients: float,
    *,
    parameters: float | None = None,
    optimizer: float | None = None,
    largest: float | None = None,
) -> tuple[float, float]:
    """The live totals of a replica's backward and optimizer step (``live_cost``):
    gradients are kept through backward where replicas reduce them in buckets, or a
    later micro-batch of an accumulation adds to them."""
    kept = replicas > 1 or run.gradient_accumulation > 1
    base = (costs.param_bytes() if parameters is None else parameters) + costs.frozen_bytes()
    base += costs.optimizer_bytes() if optimizer is None else optimizer
    slots = EXTRA_SLOT_BYTES if replicas > 1 else 0
    backward = base + slots + (gradients if kept else 0.0)
    backward += backward_peak(
        costs, samples, batch_samples=run.global_batch, recompute=recompute, grads_kept=kept
    )
    fused = replicas * costs.tensor > 1  # dp's engine runs the fused kernel (fused_optim)
    step = base + slots + gradients + step_temporaries(costs, largest, fused=fused)
    return backward, step


def predict(
    costs: ModelCosts, machine: MachineCosts, run: Run, options: dict[str, Any], replicas: int
) -> Prediction:
    """A replica among ``replicas`` (1: the single-device engine), at ``costs``' tensor
    degree."""
    accumulation = run.gradient_accumulation
    samples = run.global_batch / (replicas * accumulation)
    recompute = bool(options.get("recompute"))
    params = costs.param_bytes()
    memory = ledger_at_peak(
        parameters=params + costs.frozen_bytes(),
        gradients=params,
        optimizer=costs.optimizer_bytes(),
        activations=activations(costs, run, samples, recompute),
        communication=EXTRA_SLOT_BYTES if replicas > 1 else 0,
        communication_at_end=EXTRA_SLOT_BYTES if replicas > 1 else 0,
        gradients_persist=replicas > 1,
    )
    memory = with_transient(
        memory,
        moments=live_moments(costs, run, samples, recompute, replicas, params),
        lag=collective_lag(costs, samples),
    )
    workers = replicas * costs.tensor
    one = compute_seconds(costs, samples, accumulation, recompute)
    one += costs.optimizer.step_s_per_element * costs.elements()
    compute = machine.compute_seconds(workers * one, one)
    communication = machine.all_reduce_s(params, replicas) + tensor_seconds(
        costs, machine, samples, accumulation
    )
    return Prediction.of(
        memory, compute_s=compute, communication_s=communication, workers=workers, machine=machine
    )
