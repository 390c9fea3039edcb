"""ZB-H2: ZB-H1 with more warm-up forwards, a new action list run with no engine edit.

The simulator proves the lists free of deadlock and gives their bubble; the figures below
are exact tick counts (integers divided once), so they are compared with ``abs=1e-12``.
Parity bar: fp32 runs use the suite's ``TOLERANCE`` (1e-5 relative, ``test_parity_dp``):
B and W compute the same products as one backward (``split_backward``), only the order
of the gradient sums over micro-batches is the pipeline's, as under 1F1B and ZB-H1.
"""

from __future__ import annotations

import pytest

import paratrain
from paratrain.parallel.pipeline.cost import in_flight
from paratrain.parallel.pipeline.schedule_clock import clock_table, simulate, simulated_bubble
from paratrain.parallel.pipeline.schedules import (
    SPLIT_SCHEDULES,
    build_schedule,
    max_in_flight,
    zb_h1,
    zb_h2,
)
from paratrain.parallel.pipeline.timeline import schedule_bubble
from tests import workers, zero_bubble_workers
from tests.test_parity_dp import TOLERANCE, relative_error

SIZES = [(1, 3), (2, 1), (2, 4), (2, 8), (3, 5), (4, 4), (4, 8), (4, 16), (8, 16)]


@pytest.mark.parametrize(("stages", "micro"), SIZES)
def test_zb_h2_completes_runs_each_kind_in_order_and_warms_up_longer(stages, micro):
    schedule = zb_h2(stages, micro)
    for ticks in ((2, 1), (3, 1), (3, 2)):  # B + W, W: the lists hold on other clocks too
        simulate(schedule, backward_ticks=ticks[0], weight_ticks=ticks[1])  # raises on deadlock
    for s, actions in enumerate(schedule):
        for kind in "FBW":
            assert [a.micro for a in actions if a.kind == kind] == list(range(micro))
        warmup = next(i for i, a in enumerate(actions) if a.kind != "F")
        assert warmup == min(2 * (stages - s) - 1, micro), (s, warmup)  # ZB-H1: p - s
    assert max_in_flight(schedule) == [min(2 * stages - 1, micro)] * stages  # F to W


@pytest.mark.parametrize(("stages", "micro"), [(p, m) for p, m in SIZES if m >= p])
def test_zb_h2_bubble_against_zb_h1(stages, micro):
    """F = B = W = 1 tick: both reach ``(p - 1) / (3m + p - 1)``, the least a step that
    ends in a flush can idle (the last stage waits p - 1 forwards for its first input).
    B = 2 ticks, W = 1: ZB-H2's extra forwards cover the wait for the first output
    gradient where ZB-H1's W passes no longer do, so it idles no more than ZB-H1, and
    strictly less from 3 stages once there are micro-batches to warm up with (2p - 1)."""
    equal = (stages - 1) / (3 * micro + stages - 1)
    assert simulated_bubble(zb_h2(stages, micro)) == pytest.approx(equal, abs=1e-12)
    assert simulated_bubble(zb_h1(stages, micro)) == pytest.approx(equal, abs=1e-12)
    h2 = simulated_bubble(zb_h2(stages, micro), backward_ticks=3, weight_ticks=1)
    h1 = simulated_bubble(zb_h1(stages, micro), backward_ticks=3, weight_ticks=1)
    assert h2 <= h1 + 1e-12
    if stages >= 3 and micro >= 2 * stages - 1:
        assert h2 < h1 - 0.01, (h2, h1)


def test_zb_h2_clock_table():
    """Stage 0 warms up with 2(p - s) - 1 = 3 forwards; then it holds 2p - 1 = 3
    micro-batches, so it runs W0 before F3 (its B passes, fed data, take no tick and its W
    its whole backward: ``stage_ticks``); 13 ticks = 3m + p - 1."""
    assert clock_table(zb_h2(2, 4), backward_ticks=2) == [
        "F0 F1 F2 W0 W0 F3 W1 W1 W2 W2 .  W3 W3",
        ".  F0 B0 F1 B1 F2 W0 B2 F3 W1 B3 W2 W3",
    ]


def test_zb_h2_is_registered_as_a_split_schedule_the_planner_reads():
    assert "zb-h2" in SPLIT_SCHEDULES and build_schedule("zb-h2", 4, 8) == zb_h2(4, 8)
    assert [in_flight("zb-h2", 4, s, 8) for s in range(4)] == [7, 7, 7, 7]
    # F = B = W, one unit each: a stage idles p - 1 = 3 units, ZB-H1's (p - 1)(F + B - W),
    # beside its 8 micro-batches' 24: 3 / 27
    assert schedule_bubble("zb-h2", 4, 8)[0] == pytest.approx(3 / 27, abs=1e-12)
    times = {"forward": 1.0, "backward": 2.0, "weight": 1.0}
    assert (
        schedule_bubble("zb-h2", 4, 8, times=times)[0]
        < schedule_bubble("zb-h1", 4, 8, times=times)[0]
    )


def _parity(runs, devices):
    results = paratrain.launch(
        zero_bubble_workers.zero_bubble_worker, devices=devices, args=(runs,)
    )
    for (_, kind, opt, options), (state, losses, kinds, _) in zip(runs, results[0], strict=True):
        assert kinds == ["backward", "forward", "weight"], (kind, options)
        ref_state, ref_losses = workers.train_with("single", kind, opt, 1)
        error = relative_error(state, ref_state)
        assert error <= TOLERANCE, f"{kind} {opt} {options}: relative error {error:.2e}"
        assert losses == pytest.approx(ref_losses, rel=TOLERANCE), (kind, options)


@pytest.mark.slow
def test_zb_h2_two_stages_matches_single_device():
    _parity(
        [
            ("plain", "mlp", "sgd", {"stages": 2, "schedule": "zb-h2", "micro_batches": 4}),
            ("plain", "gpt", "adam", {"stages": 2, "schedule": "zb-h2", "micro_batches": 8}),
        ],
        devices=2,
    )


@pytest.mark.slow
def test_zb_h2_four_stages_and_two_replicas_match_single_device():
    _parity(
        [
            ("plain", "gpt", "adam", {"stages": 4, "schedule": "zb-h2", "micro_batches": 4}),
            ("plain", "deep", "sgd", {"stages": 4, "schedule": "zb-h2", "micro_batches": 8}),
            ("plain", "gpt", "sgd", {"stages": 2, "schedule": "zb-h2", "micro_batches": 4}),
            ("plain", "mlp", "adam", {"stages": 2, "schedule": "zb-h2", "micro_batches": 8}),
        ],
        devices=4,
    )
