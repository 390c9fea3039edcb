"""A checkpoint saved under one pipeline schedule resumes under another and under
``single``: the canonical checkpoint records weights and optimizer state by name, never the
schedule's order, so ZB-H1/ZB-H2 (backward split into B and W) and interleaved 1F1B
(non-adjacent chunks per worker) hand over to 1F1B and to one device alike.

Tolerance: ``TOLERANCE`` (1e-5 relative), the fp32 parity bar of tests/test_parity_dp.py:
each phase reorders the gradient sums as that schedule does, and a checkpoint carries the
fp32 values bit for bit, so the chain stays inside the bar of one uninterrupted run.
"""

from __future__ import annotations

import pytest

import paratrain
from tests import workers
from tests.test_parity_dp import TOLERANCE, relative_error

INTERLEAVED = {"stages": 2, "virtual_stages": 2, "micro_batches": 4}


@pytest.mark.slow
@pytest.mark.parametrize(("optimizer", "zero_bubble"), [("adam", "zb-h1"), ("sgd", "zb-h2")])
def test_zero_bubble_and_interleaved_checkpoints_resume_under_1f1b_and_single(
    tmp_path, optimizer, zero_bubble
):
    """zero bubble (0-3) -> 1f1b (3-6) -> interleaved (6-8) -> 1f1b (8-10), and from the
    zero-bubble and interleaved checkpoints straight to one device: every path ends at the
    uninterrupted run's weights and losses."""
    kind = "gpt"
    reference, reference_losses = workers.train_with("single", kind, optimizer, 1)
    a, b, c = (str(tmp_path / name) for name in ("a", "b", "c"))

    def phase(options, steps, load_from, save_to):
        return paratrain.launch(
            workers.checkpoint_phase,
            devices=2,
            args=("pipeline", options, kind, optimizer, steps, load_from, save_to),
        )[0]

    zb = {"stages": 2, "micro_batches": 4, "schedule": zero_bubble}
    _, losses = phase(zb, (0, 3), None, a)
    _, more = phase({"stages": 2, "micro_batches": 4}, (3, 6), a, b)
    _, later = phase(INTERLEAVED, (6, 8), b, c)
    state, last = phase({"stages": 2, "micro_batches": 4}, (8, 10), c, None)
    assert relative_error(state, reference) <= TOLERANCE, "zero bubble -> 1f1b chain"
    assert losses + more + later + last == pytest.approx(reference_losses, rel=TOLERANCE)
    for load_from, start in ((a, 3), (c, 8)):  # zero bubble, then interleaved -> single
        state, tail = workers.checkpoint_phase(
            "single", {}, kind, optimizer, (start, 10), load_from, None
        )
        assert relative_error(state, reference) <= TOLERANCE, (load_from, start)
        assert tail == pytest.approx(reference_losses[start:], rel=TOLERANCE), load_from
