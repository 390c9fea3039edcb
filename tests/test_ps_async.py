"""ps with staleness k, fully asynchronous, and synchronous with a backup worker, with a
straggler: the bound, the metrics, who waits for whom."""

from __future__ import annotations

import pytest

import paratrain
from tests import ps_workers

WORKERS, STRAGGLER, BOUND = 3, 2, 2


@pytest.fixture(scope="module")
def runs() -> dict:
    straggler = {"rank": STRAGGLER, "slowdown": 4.0}
    settings = [
        {"staleness": BOUND, "straggler": straggler},
        {"staleness": None, "straggler": straggler},
        {"staleness": 0, "backup_workers": 1, "straggler": straggler},
    ]
    results = paratrain.launch(
        ps_workers.straggler_worker, devices=WORKERS, args=(settings, 24 * 30, 24)
    )
    return {
        "bounded": [r[0] for r in results],
        "async": [r[1] for r in results],
        "backup": [r[2] for r in results],
    }


@pytest.mark.slow
def test_no_worker_runs_more_than_the_bound_ahead(runs):
    pushes = runs["bounded"][0]["metrics"]["pushes"]
    assert sorted(pushes) == list(range(WORKERS))
    # When the budget is reached the fastest may have started at most BOUND steps ahead.
    assert max(pushes.values()) - min(pushes.values()) <= BOUND + 1, pushes
    assert [r["steps"] for r in runs["bounded"]] == [pushes[w] for w in range(WORKERS)]


@pytest.mark.slow
def test_staleness_of_applied_pushes_is_bounded_and_recorded(runs):
    histogram = runs["bounded"][0]["metrics"]["staleness_histogram"]
    applied = sum(histogram.values())
    assert applied == sum(runs["bounded"][0]["metrics"]["pushes"].values())
    # Between a worker's pull and its push, each other worker pushes at most 2k + 1 times.
    assert max(histogram) <= (WORKERS - 1) * (2 * BOUND + 1), histogram
    assert max(histogram) >= 1, "three concurrent workers never pushed a stale gradient"


@pytest.mark.slow
def test_asynchronous_workers_do_not_wait_for_the_straggler(runs):
    metrics = runs["async"][0]["metrics"]
    pushes = metrics["pushes"]
    fastest = max(w for w in pushes if w != STRAGGLER)
    # A 4x slower worker that nobody waits for pushes fewer times than the others.
    assert pushes[STRAGGLER] < pushes[fastest], pushes
    assert set(metrics["pushes_per_s"]) == set(range(WORKERS))
    assert all(rate > 0 for rate in metrics["pushes_per_s"].values())
    assert metrics["lost_workers"] == {}
    assert metrics["samples_applied"] >= 24 * 30


@pytest.mark.slow
def test_a_backup_worker_lets_synchronous_rounds_go_on_without_the_straggler(runs):
    metrics = runs["backup"][0]["metrics"]
    pushes, histogram = metrics["pushes"], metrics["staleness_histogram"]
    fastest = max(w for w in pushes if w != STRAGGLER)
    assert pushes[STRAGGLER] < pushes[fastest], pushes
    # The straggler's pushes arrive after their version closed, and are folded in, not lost.
    assert max(histogram) >= 1, histogram
    assert sum(histogram.values()) == sum(pushes.values())
    assert metrics["samples_applied"] == 8 * sum(pushes.values())
    assert metrics["backup_workers"] == 1 and metrics["lost_workers"] == {}


def test_the_straggler_sleeps_between_its_pull_and_its_compute():
    # As dp's straggler in the benchmarks sleeps between one step's gradient exchange and
    # the next step's compute; the first step, with no compute to go by, sleeps after it.
    results = paratrain.launch(ps_workers.straggler_timeline, devices=2, args=(3, 1))
    events = results[1]
    assert results[0] is None
    assert [name for name, _ in events] == [
        *("pull", "compute", "sleep"),
        *("pull", "sleep", "compute"),
        *("pull", "sleep", "compute"),
    ], events
    assert all(seconds > 0 for name, seconds in events if name == "sleep"), events
