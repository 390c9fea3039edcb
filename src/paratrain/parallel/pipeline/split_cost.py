"""What a split backward (ZB-H1, ZB-H2) holds live, for the planner: pure arithmetic.

``split_backward.LayerTape`` runs B with ``retain_graph`` (W walks each layer's graph
again), so B frees none of a micro-batch's saved tensors as it goes down, unlike one
backward; and it keeps, per layer, the gradients W starts from: those of each parameter-
owning module's outputs where W takes the layer unit by unit (``weight_units``), else the
gradient that reached the layer's output. So between B and W a micro-batch holds its
saved tensors *and* those gradients for every layer of the stage (``kept_gradients``,
measured per layer by ``split_backward_kept``). Neither is freed at the moments
``cost.stage_moments`` models (a backward that releases each layer behind it), which is
why a prediction without these moments fell 14-20% under the live count on a 2-stage gpt
(``LiveTensors(trace=True)``: ``_input_grads``' sums and the retained forward's tensors
alive at the peak).

The moments are read off the stage's own actions (``schedules.split_occupancy``): at each
B, the micro-batches holding activations and those holding kept gradients, plus B's walk
(the gradients kept by the layers above, and the layer's backward temporaries); at each
W, the same counts plus one layer's weight-gradient temporaries. Gradients exist from the
step's first W on (set to None at each step's start without replicas), from the start
where replicas keep them.
"""

from __future__ import annotations

from paratrain.parallel.cost_model import ModelCosts
from paratrain.parallel.pipeline.schedules import Action, split_occupancy


def kept_by_layer(costs: ModelCosts, samples: float, index: int, recompute: bool) -> float:
    """Bytes of the gradients B keeps for one layer's W, per micro-batch: each parameter-
    owning module's outputs' where W takes them one by one (``LayerCost.kept_bytes``),
    else the layer's output's (under recompute, which walks whole layers; for the model's
    first layer, fed data; and where the layer was not measured so)."""
    layer = costs.layers[index]
    if recompute or index == 0 or layer.kept_bytes is None:
        return layer.output_bytes.at(samples)
    return layer.kept_bytes.at(samples)


def kept_gradients(
    costs: ModelCosts, samples: float, layers: list[int], recompute: bool = False
) -> float:
    """Bytes of the gradients B keeps for W, per micro-batch, over the stage's layers."""
    return sum(kept_by_layer(costs, samples, i, recompute) for i in layers)


def _beyond_saved(costs: ModelCosts, samples: float, index: int, recompute: bool) -> float:
    """A layer's backward temporaries beyond what the micro-batch already holds for it:
    its transient less its saved tensors (held since F), all of it under recompute (the
    layer's forward runs again in B and in W, rebuilding them)."""
    layer = costs.layers[index]
    held = 0.0 if recompute else layer.saved.at(samples)
    return max(0.0, layer.transient.at(samples) - held)


def b_walk(costs: ModelCosts, samples: float, layers: list[int], recompute: bool) -> float:
    """B's highest moment down the stage beyond its saved tensors: at each layer, the
    gradients the layers above it keep, and its own backward's temporaries."""
    above = peak = 0.0
    for index in reversed(layers):
        peak = max(peak, above + _beyond_saved(costs, samples, index, recompute))
        above += kept_by_layer(costs, samples, index, recompute)
    return peak


def split_moments(
    costs: ModelCosts,
    samples: float,
    layers: list[int],
    actions: list[Action],
    *,
    base: float,
    one: float,
    grads_kept: bool,
    recompute: bool,
) -> tuple[float, ...]:
    """A stage's whole-worker live totals at each B and W of its ``actions``: ``base``
    (parameters, optimizer state, link buffers), the gradients where they exist, ``one``
    saved bytes per micro-batch holding activations, the kept output gradients, and the
    pass's own walk (``b_walk``, or one layer's weight-gradient temporaries for W)."""
    params = costs.param_bytes(layers)
    kept = kept_gradients(costs, samples, layers, recompute)
    down = b_walk(costs, samples, layers, recompute)
    weights = max((_beyond_saved(costs, samples, i, recompute) for i in layers), default=0.0)
    moments, weighted = [], grads_kept
    for kind, held, keeping in split_occupancy(actions):
        weighted = weighted or kind == "W"
        walk = down if kind == "B" else weights
        moments.append(base + (params if weighted else 0.0) + held * one + keeping * kept + walk)
    return tuple(moments)
