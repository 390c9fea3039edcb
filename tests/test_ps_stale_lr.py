"""The staleness-aware learning rate of asynchronous ps, checked on an in-process server.

Exact numbers: one 3-vector at zero under SGD with lr 1, pushes whose staleness the test
sets through the version they claim to have pulled.
"""

from __future__ import annotations

import pytest
import torch

from paratrain.parallel.ps.stale_lr import (
    check_policy,
    lr_factor,
    scaled_learning_rate,
)
from tests.test_ps_precision import push, shard_server, weight


def test_the_factor_divides_by_staleness_plus_one_and_leaves_fresh_pushes_alone():
    # Staleness 1 is one update behind already: it shares that update's step.
    assert [lr_factor("inverse", s) for s in (0, 1, 2, 4)] == [1.0, 0.5, 1 / 3, 0.2]
    assert [lr_factor("constant", s) for s in (0, 1, 4)] == [1.0, 1.0, 1.0]


def test_an_unknown_policy_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="staleness_lr must be one of 'inverse', 'constant'"):
        check_policy("linear")


def test_the_users_learning_rate_comes_back_even_when_the_step_fails():
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([param], lr=0.3)
    with pytest.raises(RuntimeError, match="boom"):
        with scaled_learning_rate(optimizer, 0.5):
            # 0.3 x 0.5 in float64: one rounding (1.1e-16), inside approx's rel 1e-6
            assert optimizer.param_groups[0]["lr"] == pytest.approx(0.15)
            raise RuntimeError("boom")
    assert optimizer.param_groups[0]["lr"] == 0.3


@pytest.mark.parametrize(
    ("policy", "factors"), [("inverse", [1.0, 0.5, 1 / 3, 0.25]), ("constant", [1.0] * 4)]
)
def test_a_stale_push_moves_the_parameters_less_under_inverse(policy, factors):
    server = shard_server(staleness=None, staleness_lr=policy)
    push(server, 0, 1.0)  # fresh: staleness 0
    push(server, 1, 1.0, pulled=0)  # staleness 1
    push(server, 0, 1.0, pulled=0)  # staleness 2
    push(server, 1, 1.0, pulled=0)  # staleness 3
    # fp32 steps of lr x factor: four roundings of 2^-24, inside approx's default 1e-6.
    assert weight(server) == pytest.approx([-sum(factors)] * 3)
    assert server.optimizer.param_groups[0]["lr"] == 1.0
    metrics = server._metrics()
    assert metrics["staleness_lr"] == policy
    assert metrics["mean_lr_factor"] == pytest.approx(sum(factors) / 4)
    assert metrics["staleness_histogram"] == {"0": 1, "1": 1, "2": 1, "3": 1}


def test_synchronous_rounds_ignore_the_policy():
    server = shard_server(staleness=0, staleness_lr="inverse")
    push(server, 0, 2.0)
    push(server, 1, 4.0)
    assert weight(server) == [-3.0] * 3
    assert server._metrics()["mean_lr_factor"] == 1.0
