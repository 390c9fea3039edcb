"""Layers users write that the zero-bubble W's unit proof must see through
(``tests/user_layers``: weights computed by parametrizations, values changed in place)
train as the plain loop under every schedule, and the proof accepts them.

The zero-bubble W takes each parameter-owning module's weight gradients from that
module's outputs, where the graph proves it exact (``pipeline/weight_units``); a unit
proved wrongly loses a share of a gradient silently (the last defect found there: 64 of
64 entries of a weight's gradient). A parametrized weight is made by a module the layer
calls inside its own forward, from parameters that module owns; an in-place change moves
a tensor's version after the call that made it. These pass on the current code; they
guard the proof's edges.

Tolerance: the suite's (``TOLERANCE``, 1e-5 relative per parameter): the pipeline sums
the micro-batches' gradients where the plain loop takes one backward over the batch, fp32
reduction order, about 1e-7 relative a step over these 10 steps (measured 7e-8 to 1e-7).
"""

from __future__ import annotations

import pytest

import paratrain
from paratrain.models import loss_for
from tests import user_layers, workers
from tests.schedule_memory_workers import SCHEDULES
from tests.test_parity_dp import TOLERANCE, relative_error

PIPELINE = {"stages": 2, "micro_batches": 4}
OPTIONS = [
    {**PIPELINE, **SCHEDULES[name]} for name in ("1f1b", "interleaved", "zb-h1", "zb-h2")
] + [{**PIPELINE, "schedule": "zb-h1", "recompute": True}]


@pytest.mark.slow
def test_parametrized_and_in_place_layers_train_as_the_plain_loop_under_every_schedule():
    """weight_norm, a user's parametrization and in-place blocks, 2 stages of 4
    micro-batches, SGD-momentum and Adam. Without recompute no chunk's W was taken whole
    (the proof accepted every micro-batch: W did not redo B); recompute cuts by design."""
    runs = [
        (kind, optimizer, options)
        for kind in user_layers.KINDS
        for options in OPTIONS
        for optimizer in ("sgd", "adam")
    ]
    results = paratrain.launch(user_layers.pipeline_worker, devices=2, args=(runs,))
    for index, (kind, optimizer, options) in enumerate(runs):
        state, _ = results[0][index]
        model, batches = workers.parity_model(kind), workers.parity_batches(kind)
        plain = workers.plain_loop_state(model, optimizer, batches, loss_for("mlp"))
        label = f"{kind}, {optimizer}, {options}"
        error = relative_error(state, plain)
        assert error <= TOLERANCE, f"{label}: relative error {error:.2e}"
        if "zb" in options.get("schedule", "") and not options.get("recompute"):
            assert [rank[index][1] for rank in results] == [[], []], label


@pytest.mark.slow
def test_a_stage_holding_only_stateless_layers_trains_as_the_plain_loop():
    """A model that is no layer list, cut at ``body.1``: the first stage holds a Flatten
    alone. Its forward still runs the model and the blocks' container (they walk the
    blocks on every stage); before, the setup moved the whole model to meta there and
    failed with torch's "Cannot copy out of meta tensor". 1F1B and ZB-H1, Adam."""
    runs = [
        ("wrapped", "adam", {**PIPELINE, "schedule": schedule, "split_points": ["body.1"]})
        for schedule in ("1f1b", "zb-h1")
    ]
    results = paratrain.launch(user_layers.pipeline_worker, devices=2, args=(runs,))
    model, batches = workers.parity_model("wrapped"), workers.parity_batches("mlp")
    plain = workers.plain_loop_state(model, "adam", batches, loss_for("mlp"))
    for (_, _, options), (state, _) in zip(runs, results[0], strict=True):
        error = relative_error(state, plain)
        assert error <= TOLERANCE, f"{options}: relative error {error:.2e}"
