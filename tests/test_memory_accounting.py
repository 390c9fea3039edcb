"""Model-state bytes per worker follow the formulas: fp32 Adam holds 4 + 4 + 8 bytes per
parameter, on every dp replica, and split by layer over pipeline stages."""

from __future__ import annotations

import pytest

import paratrain
from paratrain.models import build_model, count_parameters
from tests import workers

PARAMS = count_parameters(build_model("mlp", in_features=64, hidden=256, depth=2, classes=8))


def within(actual: int, expected: float, tolerance: float = 0.05) -> bool:
    return abs(actual - expected) <= tolerance * expected


@pytest.mark.slow
def test_dp_replicas_each_hold_the_whole_model_state():
    results = paratrain.launch(workers.model_state_after_one_step, devices=2, args=("dp", {}))
    for ledger in results:
        assert ledger["parameters"] == 4 * PARAMS
        assert within(ledger["gradients"], 4 * PARAMS)  # the buckets, plus a loss slot
        assert within(ledger["optimizer"], 8 * PARAMS)  # exp_avg, exp_avg_sq (+ step scalars)


@pytest.mark.slow
def test_pipeline_stages_split_the_model_state():
    results = paratrain.launch(
        workers.model_state_after_one_step, devices=2, args=("pipeline", {"stages": 2})
    )
    assert sum(r["parameters"] for r in results) == 4 * PARAMS
    assert within(sum(r["gradients"] for r in results), 4 * PARAMS)
    assert within(sum(r["optimizer"] for r in results), 8 * PARAMS)
    assert all(0 < r["parameters"] < 4 * PARAMS for r in results)


def test_single_engine_ledger_without_a_process_group():
    ledger = workers.model_state_after_one_step("single", {})
    assert ledger["parameters"] == 4 * PARAMS
    assert ledger["gradients"] == 4 * PARAMS
    assert within(ledger["optimizer"], 8 * PARAMS)
