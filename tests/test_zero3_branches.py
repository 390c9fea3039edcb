"""zero3 with a unit that some replicas run and others skip in the same step (a branch
the data chooses, masked per sample): every replica still issues the same gathers and
reduce-scatters, and training equals the plain single-process loop.

Before, the replica that skipped the branch gathered the next unit while the others
gathered the branch, and the run stopped in that gather (gloo aborted on the size
mismatch, or the wait ran into the group timeout); the short ``timeout_s`` makes such a
regression fail in seconds instead of holding the suite.

Tolerance: the suite's 1e-5 relative (``TOLERANCE``). As in test_zero_param_groups.py,
the runs differ from the plain loop only in the order fp32 sums each gradient over the
batch (8 samples, split over the replicas), about sqrt(8) x 2^-24 = 1.7e-7 relative; SGD
is linear in the gradient, so the parameters differ by at most that times the path they
travel over their norm, 1.43 in these 4 steps (measured per tensor): about 2.4e-7, far
below the bar, while a lost or doubled branch gradient is O(1).
"""

from __future__ import annotations

import pytest

import paratrain
from tests import zero3_branch_workers as branches
from tests.test_parity_dp import TOLERANCE, relative_error


@pytest.mark.slow
@pytest.mark.parametrize("devices", [2, 4])
def test_a_branch_some_replicas_skip_trains_as_the_plain_loop(devices):
    states = paratrain.launch(branches.train, devices=devices, args=("zero3",), timeout_s=30)
    reference = branches.plain_loop()
    for state in states:
        assert relative_error(state, reference) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("devices", [2, 4])
def test_a_parameter_some_replicas_leave_out_of_a_unit_they_all_run_trains_exactly(devices):
    """``gated.branch`` is unused on some replicas inside the second of four units: before
    ``zero/reach.py`` those replicas held that unit's reduction to the end of backward
    while the others waited in it before their next gather (a timeout). Same tolerance
    as above."""
    states = paratrain.launch(
        branches.train, devices=devices, args=("zero3", "gated"), timeout_s=30
    )
    reference = branches.plain_loop("gated")
    for state in states:
        assert relative_error(state, reference) <= TOLERANCE
