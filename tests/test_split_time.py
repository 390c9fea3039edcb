"""What a zero-bubble split backward costs in time, measured and priced by the planner.

A split backward (F recording the weight modules' calls, B to the input keeping the graph,
W walking it module by module) costs more than one backward: 1.09-1.15x a gpt block's
plain pair on this machine, 1.2-1.8x a small linear layer's, and the runner adds a W pass
a micro-batch. The planner priced B and W as the two halves of one backward, so it ranked
ZB-H1 and ZB-H2 10-14% ahead of 1F1B where they ran at 1F1B's speed or slower
(``split_backward_time``, ``LayerCost.split_factor``, ``runner_probe``'s zero-bubble figure).
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from torch import nn

import paratrain
from paratrain.parallel.cost_model import Line, MachineCosts, Run
from paratrain.parallel.layout import Layout
from paratrain.parallel.pipeline import cost as pipeline_cost
from paratrain.parallel.split_backward_time import split_layer_pass
from paratrain.planner.measure import measure_model, measure_optimizer
from tests import planner_workers as pw


def _layer() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))


def test_the_timed_split_pass_is_the_engines_f_b_and_w_and_leaves_the_gradients_as_found():
    layer = _layer()
    x = torch.randn(4, 8)
    params = list(layer.parameters())
    expected = torch.autograd.grad(layer(x.requires_grad_(True)).sum(), params)
    before = torch.full_like(params[0], 7.0)
    params[0].grad = before  # the user's model: whatever .grad it holds stays
    with split_layer_pass(layer, ((x.detach(),), {}), contextlib.nullcontext) as triple:
        for p in params:
            p.grad = None
        triple()  # W accumulates the weight gradients B's gradients of ones lead to
        found = [p.grad for p in params]
    # the same products as the plain backward's, through B's kept unit gradients: equal
    # to a few float32 ulps (another kernel may sum in another order), assert_close's
    # float32 default (rtol 1.3e-6, atol 1e-5) covers it
    for got, want in zip(found, expected, strict=True):
        torch.testing.assert_close(got, want)
    assert params[0].grad is before and all(p.grad is None for p in params[1:])


def _measured():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 4))
    sample = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    costs = measure_model(
        model,
        sample,
        loss_fn=nn.functional.cross_entropy,
        optimizer=measure_optimizer(pw.adam),
        tensor=1,
    )
    return model, costs


def test_each_layer_of_a_layer_list_carries_its_measured_split_factor():
    model, costs = _measured()
    factors = [layer.split_factor for layer in costs.layers]
    assert len(factors) == 4 and all(f is not None and f >= 1.0 for f in factors)
    assert all(p.grad is None for p in model.parameters())  # measuring left no gradient


def _one_core_costs(costs, factor: float | None):
    """``costs``' layers with known times (1e-4 s a pass pair, whatever the samples,
    ``planner_workers.flat_times``) and ``factor``: on one core the step is every stage's
    work added up, so what a stage pays shows in full."""
    flat = pw.flat_times(costs, 1e-4)
    layers = tuple(dataclasses.replace(layer, split_factor=factor) for layer in flat.layers)
    return dataclasses.replace(flat, layers=layers)


ONE_CORE = MachineCosts(cores=1, backend="gloo", all_reduce={2: Line(1e-3, 1e-9)}, send=Line.zero())


def test_a_split_stage_pays_its_layers_split_factor_and_a_stage_fed_data_does_not():
    measured = _measured()[1]  # one measurement: its pass_s (timed) alike in both
    costs, plain = _one_core_costs(measured, 1.5), _one_core_costs(measured, None)
    layers = [1, 2, 3]
    split = [
        pipeline_cost.micro_batch_seconds(c, ONE_CORE, 4.0, layers, ([], []), False, True, 1)
        for c in (costs, plain)
    ]
    # half of each layer's 1e-4 s more; sums of the same float terms: equal to rounding
    assert split[0] - split[1] == pytest.approx(0.5 * 3 * 1e-4, rel=1e-9)
    unsplit = [
        pipeline_cost.micro_batch_seconds(c, ONE_CORE, 4.0, layers, ([], []), False, False, 1)
        for c in (costs, plain)
    ]
    assert unsplit[0] == unsplit[1]
    run, layout = Run(devices=2, global_batch=16), Layout.over(2, stages=2)
    for schedule in ("1f1b", "zb-h1", "zb-h2"):
        options = {"micro_batches": 4, "schedule": schedule, "virtual_stages": 1}
        more, less = (
            pipeline_cost.predict(c, c, ONE_CORE, run, options, layout=layout).step_s
            for c in (costs, plain)
        )
        if schedule == "1f1b":
            assert more == less  # nothing split, nothing more
        else:  # the last stage splits; the first, fed data, runs one backward as W
            assert more > less


def test_a_split_stage_pays_the_zero_bubble_runners_figure_and_others_the_plain_one():
    costs = _one_core_costs(_measured()[1], None)
    plain_figure, split_figure = 0.01, 0.03
    figures = {
        pipeline_cost.MICRO_BATCH_FIGURE: plain_figure,
        pipeline_cost.SPLIT_MICRO_BATCH_FIGURE: split_figure,
    }
    charged = dataclasses.replace(ONE_CORE, figures={"pipeline": figures})
    run, layout = Run(devices=2, global_batch=16), Layout.over(2, stages=2)
    for schedule, per_micro in (("1f1b", 2 * plain_figure), ("zb-h1", plain_figure + split_figure)):
        for micro in (4, 8):
            options = {"micro_batches": micro, "schedule": schedule, "virtual_stages": 1}
            more, less = (
                pipeline_cost.predict(costs, costs, m, run, options, layout=layout).step_s
                for m in (charged, ONE_CORE)
            )
            # stage 0 (fed data, unsplit) pays the plain figure, stage 1 its schedule's;
            # float sums of the same terms
            assert more - less == pytest.approx(micro * per_micro, rel=1e-9), schedule
    old_file = dataclasses.replace(
        ONE_CORE, figures={"pipeline": {pipeline_cost.MICRO_BATCH_FIGURE: plain_figure}}
    )
    options = {"micro_batches": 4, "schedule": "zb-h1", "virtual_stages": 1}
    falls_back, none = (
        pipeline_cost.predict(costs, costs, m, run, options, layout=layout).step_s
        for m in (old_file, ONE_CORE)
    )
    assert falls_back - none == pytest.approx(4 * 2 * plain_figure, rel=1e-9)


def test_the_runner_is_timed_under_each_schedule_asked_for_on_every_worker_alike():
    from paratrain.parallel.pipeline import runner_probe

    figures = paratrain.launch(
        runner_probe.micro_batch_seconds, devices=2, args=(("gpipe", "zb-h1"),)
    )
    assert figures[0] == figures[1]  # every worker gets the slowest one's figures
    assert set(figures[0]) == {"gpipe", "zb-h1"} and all(v > 0 for v in figures[0].values())
