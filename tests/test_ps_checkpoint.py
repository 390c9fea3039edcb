"""ps checkpoints are ordinary checkpoints: ps -> single and single -> ps resume exactly."""

from __future__ import annotations

import pytest

import paratrain
from tests import workers
from tests.test_parity_dp import TOLERANCE, relative_error

CASE = ("mlp", "adam")
PS = {"staleness": 0, "servers": 2}


@pytest.mark.slow
def test_ps_checkpoint_resumes_in_single_and_single_checkpoint_resumes_in_ps(tmp_path):
    reference, _ = workers.checkpoint_phase("single", {}, *CASE, (0, 10), None, None)
    ps_saved = tmp_path / "ps-5"
    paratrain.launch(
        workers.checkpoint_phase, devices=2, args=("ps", PS, *CASE, (0, 5), None, str(ps_saved))
    )
    resumed, _ = workers.checkpoint_phase("single", {}, *CASE, (5, 10), str(ps_saved), None)
    assert relative_error(resumed, reference) <= TOLERANCE

    single_saved = tmp_path / "single-5"
    workers.checkpoint_phase("single", {}, *CASE, (0, 5), None, str(single_saved))
    results = paratrain.launch(
        workers.checkpoint_phase,
        devices=2,
        args=("ps", PS, *CASE, (5, 10), str(single_saved), None),
    )
    for state, _ in results:
        assert relative_error(state, reference) <= TOLERANCE
