"""ps faults: a lost worker leaves the run going; a lost server stops it, clearly, at once."""

from __future__ import annotations

import time

import pytest

import paratrain
from paratrain.runtime.launch import LostWorker
from tests import ps_workers
from tests.test_launch import _alive


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    """The pids still alive after waiting up to ``seconds`` for them to exit."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.1)
    return [pid for pid in pids if _alive(pid)]


@pytest.mark.slow
def test_a_dead_worker_is_recorded_and_the_others_finish():
    """Synchronous mode is the hard case: the survivors' steps wait for every live worker."""
    steps, options = 12, {"staleness": 0, "servers": 2}
    results = paratrain.launch(ps_workers.lose_a_worker, devices=3, args=(options, steps, 1, 4))
    assert isinstance(results[1], LostWorker) and results[1].rank == 1
    assert "SIGKILL" in results[1].reason
    for rank in (0, 2):
        assert results[rank]["steps"] == steps
    metrics = results[0]["metrics"]
    assert list(metrics["lost_workers"]) == [1]
    assert metrics["pushes"][1] == 3 and metrics["pushes"][0] == steps
    assert _gone_within(results[0]["server_pids"], 10.0) == [], "a server outlived the job"


@pytest.mark.slow
def test_a_dead_server_stops_the_run_with_a_clear_error(tmp_path):
    pid_file = tmp_path / "servers"
    start = time.monotonic()
    with pytest.raises(paratrain.WorkerError) as caught:
        paratrain.launch(
            ps_workers.lose_a_server, devices=2, args=({"servers": 2}, str(pid_file), 3)
        )
    assert time.monotonic() - start < 60, "losing a server took too long to stop the run"
    assert "parameter server 0" in str(caught.value)
    assert "cannot go on" in str(caught.value)
    pids = [int(p) for p in pid_file.read_text().split()]
    assert _gone_within(pids, 10.0) == [], "a server outlived the job"
