"""A worker that skips a collective makes the others fail within the timeout, naming it."""

from __future__ import annotations

import time

import pytest

import paratrain
from tests import workers


@pytest.mark.slow
def test_skipped_collective_names_the_operation_and_the_missing_rank():
    start = time.monotonic()
    with pytest.raises(paratrain.WorkerError) as caught:
        paratrain.launch(workers.skip_a_collective, devices=3, timeout_s=4)
    elapsed = time.monotonic() - start
    message = str(caught.value)
    assert "CollectiveTimeout" in message
    assert "all_reduce (collective #2 of rank" in message
    assert "rank 1 did not arrive (is not in any collective, #1)" in message
    assert "rank 2 did not arrive" not in message and "rank 0 did not arrive" not in message
    assert elapsed < 30, f"the timeout took {elapsed:.0f}s"
