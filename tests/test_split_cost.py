"""A split backward's live moments (``pipeline/split_cost``), against exact tables.

Every cost below is a whole number of bytes per sample (``Line(0, k)``) at whole sample
counts, so each sum is exact in binary: the tests compare with ``==``.
"""

from __future__ import annotations

import dataclasses

from paratrain.parallel.cost_model import Envelope, LayerCost, Line, ModelCosts, OptimizerCost
from paratrain.parallel.pipeline.schedules import build_schedule, split_occupancy
from paratrain.parallel.pipeline.split_cost import b_walk, kept_gradients, split_moments


def _layer(params: int, saved: int, output: int, transient: int) -> LayerCost:
    zero = Line(0.0, 0.0)
    return LayerCost(
        name="layer",
        param_bytes=params,
        all_param_elements=params // 4,
        param_elements=params // 4,
        param_tensors=1,
        frozen_bytes=0,
        frozen_params=0,
        saved=Line(0.0, saved),
        input_saved=zero,
        input_bytes=Line(0.0, output),
        output_bytes=Line(0.0, output),
        time_s=zero,
        forward_s=zero,
        transient=Envelope.of(Line(0.0, transient)),
    )


# per sample: saved, output, transient (saved + output + its gradient + 5 of temporaries)
COSTS = ModelCosts(
    layers=(_layer(400, 10, 3, 21), _layer(800, 20, 5, 35)),
    layer_list=True,
    tensor=1,
    precision="fp32",
    parameters=300,
    optimizer=OptimizerCost(8.0, 4.0, 0.0),
)


def test_each_b_and_w_is_read_off_the_stages_actions():
    # ZB-H1, 2 stages, 2 micro-batches: stage 0 F0 F1 B0 W0 B1 W1, stage 1 F0 B0 F1 B1 W0 W1
    first, last = build_schedule("zb-h1", 2, 2)
    assert split_occupancy(first) == [("B", 2, 0), ("W", 2, 1), ("B", 1, 0), ("W", 1, 1)]
    assert split_occupancy(last) == [("B", 1, 0), ("B", 2, 1), ("W", 2, 2), ("W", 1, 1)]


def test_b_keeps_each_layers_output_gradient_and_walks_down_with_the_graph_retained():
    assert kept_gradients(COSTS, 2, [0, 1]) == 2 * (3 + 5)
    # layer 1 first: its transient less its saved (15/sample); then layer 0 with layer 1's
    # output gradient kept: 5 + (21 - 10) = 16/sample
    assert b_walk(COSTS, 2, [0, 1], recompute=False) == 2 * 16
    # recompute rebuilds each layer's saved tensors in B: its whole transient
    assert b_walk(COSTS, 2, [0, 1], recompute=True) == 2 * max(35, 5 + 21)


def test_the_last_stages_moments_under_zb_h1():
    """B0 (nothing kept, no gradients yet), B1 (B0's gradients kept), then each W with the
    weights' gradients made; ``one`` saved bytes per micro-batch holding activations."""
    _, last = build_schedule("zb-h1", 2, 2)
    base, one, samples = 1000.0, 60.0, 2
    moments = split_moments(
        COSTS, samples, [0, 1], last, base=base, one=one, grads_kept=False, recompute=False
    )
    kept, walk, weights, grads = 16.0, 32.0, 2 * 15.0, 1200.0
    assert moments == (
        base + 1 * one + walk,
        base + 2 * one + kept + walk,
        base + grads + 2 * one + 2 * kept + weights,
        base + grads + 1 * one + kept + weights,
    )
    replicated = split_moments(
        COSTS, samples, [0, 1], last, base=base, one=one, grads_kept=True, recompute=False
    )
    assert replicated[0] == moments[0] + grads  # replicas keep the gradients between steps


def test_b_keeps_what_the_measure_found_except_where_w_walks_the_whole_layer():
    """``kept_bytes`` (measured: each parameter-owning module's outputs' gradients) is
    what B keeps for a layer; the model's first layer (its input carries no gradient) and
    recompute (the whole-layer W) keep the output's gradient instead."""
    kept = [
        dataclasses.replace(layer, kept_bytes=Line(0.0, 7 * (i + 1)))
        for i, layer in enumerate(COSTS.layers)
    ]
    costs = dataclasses.replace(COSTS, layers=tuple(kept))
    assert kept_gradients(costs, 2, [0, 1]) == 2 * (3 + 14)
    assert kept_gradients(costs, 2, [1]) == 2 * 14
    assert kept_gradients(costs, 2, [0, 1], recompute=True) == 2 * (3 + 5)
