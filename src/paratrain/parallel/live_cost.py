"""What a worker holds live beyond its ledger, for the planner: pure arithmetic.

The ledger (``runtime/ledger``) books parameters, gradients, optimizer state, the
activations autograd saves and communication buffers at the points an engine measures.
A device runs out of *live* storages, at any instant: the independent count
(``runtime/live_tensors``) sees more, at two moments the ledger does not sample:

- in backward, at the loss (its own peak alone, ``ModelCosts.loss_transient``, over all
  the layers hold for their backward) or at some layer: what the earlier layers still
  hold for their own backward,
  the gradients already made (where they are not kept between steps), and the layer's
  own backward at its peak (``LayerCost.transient``: its saved tensors, its output's
  gradient, its operators' temporaries, its input's and parameters' gradients). Under
  recompute the layer's segment is rebuilt first, so its saved tensors are back while
  the earlier segments keep only their inputs;
- in the optimizer step: parameters, gradients and state, plus the step's temporaries
  (``OptimizerCost.temporary_bytes_per_element`` times the largest tensor it updates).

Each strategy's ``cost.py`` gives the ledger at its peak and these two moments;
``with_transient`` adds the ``transient`` category: what the highest of the moments holds
beyond the ledger's peak. The per-layer peaks are measured with each layer alone, so a
layer whose input storage is not saved by an earlier layer (a linear after a linear) has
that input counted once more by the layers' sum, never less: the estimate errs high.
"""

from __future__ import annotations

from collections.abc import Sequence

from paratrain.parallel.cost_model import ModelCosts

TRANSIENT = "transient"
"""The category of a prediction that the ledger never books (see the module docstring)."""


def backward_peak(
    costs: ModelCosts,
    samples: float,
    layers: range | None = None,
    *,
    batch_samples: float | None = None,
    recompute: bool = False,
    one_segment: bool = False,
    grads_kept: bool = False,
    kept_share: float = 1.0,
    gathered: Sequence[float] | None = None,
    scattered: Sequence[float] | None = None,
) -> float:
    """Bytes one micro-batch of ``samples`` has live at the highest moment of its backward
    through ``layers`` (all by default), beyond the parameters, the optimizer state and,
    where ``grads_kept``, the gradients (kept between steps, booked apart); without them
    the gradients of the layers backward has passed are counted here. ``recompute`` and
    ``one_segment`` as in ``ModelCosts.recomputed_saved``. ZeRO: ``kept_share`` of a
    layer's gradients stays once backward has passed it (its slice), and layer ``i``'s
    backward holds ``gathered[i]`` bytes more (stage 3: its unit gathered whole, the
    previous unit's message in flight, the root), and once it is done ``scattered[i]``
    (stage 3: a unit's gradients and their flat copy, then the flat copy, the backend's
    staged copy and the slice)."""
    picked = list(range(len(costs.layers)) if layers is None else layers)
    if not picked:
        return 0.0
    batch = samples if batch_samples is None else batch_samples
    first = picked[0]
    start = (
        costs.inputs_saved.at(batch) if first == 0 else costs.layers[first].input_saved.at(samples)
    )
    held_before: list[float] = []
    kept = 0.0  # what the segments before the current one keep (recompute: their inputs)
    segment = 0.0  # what the current segment's layers saved so far
    for i in picked:
        layer = costs.layers[i]
        starts = i == first or (
            recompute and not one_segment and (layer.param_bytes or layer.frozen_params)
        )
        if recompute and starts:
            kept += layer.input_bytes.at(samples) if i != 0 else costs.inputs_saved.at(batch)
            segment = 0.0
        held_before.append((kept if recompute else start) + segment)
        segment += layer.saved.at(samples)
    peak, made = 0.0, 0.0
    if picked[-1] == len(costs.layers) - 1:  # backward's first moment: the loss's own
        peak = (kept if recompute else start + segment) + costs.loss_transient.at(samples)
    for position in reversed(range(len(picked))):
        index = picked[position]
        layer = costs.layers[index]
        extra = gathered[index] if gathered is not None else 0.0
        held = held_before[position] + made
        peak = max(peak, held + layer.transient.at(samples) + extra)
        peak = max(peak, held + (scattered[index] if scattered is not None else 0.0))
        if not grads_kept:
            made += layer.param_bytes * kept_share
    return peak


def step_temporaries(
    costs: ModelCosts, largest_elements: float | None = None, *, fused: bool = False
) -> float:
    """Bytes an optimizer step makes and frees: at the largest tensor it updates
    (``largest_elements``; the model's largest parameter by default), ``fused`` where the
    engine rebuilt it with the fused kernel (dp, tp, the pipeline, ZeRO)."""
    if largest_elements is None:
        largest_elements = max((layer.largest_param_elements for layer in costs.layers), default=0)
    optimizer = costs.optimizer
    per_element = (
        optimizer.fused_temporary_bytes_per_element
        if fused
        else optimizer.temporary_bytes_per_element
    )
    return per_element * largest_elements


def reduce_scatter_staging(backend: str, payload: float) -> float:
    """Bytes a reduce-scatter of ``payload`` bytes holds beyond its input and output:
    gloo has no reduce-scatter of its own, and torch's gloo backend sums a copy of the
    whole input (an all-reduce) before keeping this rank's slice (seen by the live count:
    one payload more at ZeRO's reduce-scatter); NCCL reduces in place."""
    return payload if backend == "gloo" else 0.0


def collective_lag(costs: ModelCosts, samples: float) -> float:
    """Bytes of one tensor-group message (``tensor/mappings``: a split layer's all-reduce
    of the activation or its gradient, b x s x h; the mean where sizes differ) that may
    still be alive at any moment after its use: the backend's worker thread holds the
    buffer until it gets to drop its finished work, after the caller has moved on. Seen
    by the live count as a bimodal peak (gpt at tensor 4 on 4 workers sharing 2 cores:
    1 run in 3 held the last forward all-reduce's 16 KiB through the loss's backward).
    No tensor split, no message."""
    if costs.tensor <= 1:
        return 0.0
    messages = costs.tensor_messages.at(samples)
    return costs.tensor_bytes.at(samples) / messages if messages >= 1 else 0.0


def with_transient(
    ledger: dict[str, int], *, moments: tuple[float, ...], lag: float = 0.0
) -> dict[str, int]:
    """``ledger`` (its categories at its peak) with ``transient``: what the highest of the
    live ``moments`` (whole-worker byte totals) and the ledger's own peak holds beyond
    that peak, plus ``lag`` (``collective_lag``: a message that may outlive its use at
    any of them)."""
    booked = sum(ledger.values())
    extra = max((moment - booked for moment in moments), default=0.0)
    return {**ledger, TRANSIENT: int(round(max(0.0, extra) + lag))}
