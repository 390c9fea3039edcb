"""Synchronous ps rounds with backup workers, checked on an in-process server.

Exact numbers: one 3-vector at zero under SGD with lr 1, three workers, one backup, so a
version closes on two fresh pushes; the test sets each push's staleness through the
version it claims to have pulled.
"""

from __future__ import annotations

import pytest

from paratrain.parallel.ps.backup import check_backup_workers, quorum
from tests.test_ps_precision import push, shard_server, weight


def backup_server(staleness_lr: str = "inverse"):
    return shard_server(staleness=0, staleness_lr=staleness_lr, workers=3, backup_workers=1)


@pytest.mark.parametrize(
    ("backup", "staleness", "workers", "message"),
    [
        (-1, 0, 4, "backup_workers must be a non-negative integer, not -1"),
        (True, 0, 4, "non-negative integer, not True"),
        (1, None, 4, "backup_workers applies to synchronous ps only: pass staleness=0"),
        (1, 2, 4, "staleness=2 never waits"),
        (4, 0, 4, "less than the number of workers \\(4\\), not 4"),
    ],
)
def test_bad_backup_counts_are_refused_with_what_to_change(backup, staleness, workers, message):
    with pytest.raises(ValueError, match=message):
        check_backup_workers(backup, staleness, workers)


def test_the_quorum_is_all_live_workers_but_the_backups_and_never_zero():
    assert check_backup_workers(0, None, 4) == 0 and check_backup_workers(3, 0, 4) == 3
    assert [quorum(live, 1) for live in (4, 3, 2, 1, 0)] == [3, 2, 1, 1, 1]


def test_a_version_closes_on_the_first_fresh_pushes_and_late_ones_fold_in():
    server = backup_server()
    push(server, 0, 1.0)
    assert server.version == 0 and not server._may_pull(0), "worker 0 waits for the version"
    assert server._may_pull(1), "a worker that has not pushed on this version may start"
    push(server, 2, 3.0)  # the quorum of two: the straggler (worker 1) is not waited for
    assert (server.version, weight(server)) == (1, [-2.0] * 3)
    assert server._may_pull(0) and server._may_pull(2)
    push(server, 0, 2.0)
    push(server, 2, 2.0)
    assert (server.version, weight(server)) == (2, [-4.0] * 3)
    push(server, 1, 6.0, pulled=0)  # two versions late: weight 1/3, and no version yet
    assert server.version == 2 and server._may_pull(1), "a late pusher starts again at once"
    push(server, 0, 1.0)
    push(server, 2, 2.0)
    # (6 / 3 + 1 + 2) / (1 / 3 + 1 + 1) = 15 / 7: the weighted mean of everything carried.
    # The server's fp32 arithmetic: a few roundings of 2^-24, inside approx's default 1e-6.
    assert server.version == 3 and weight(server) == pytest.approx([-4.0 - 15 / 7] * 3)
    assert server.samples_applied == 8 * 7, "a late push's samples count as applied"
    metrics = server._metrics()
    assert metrics["staleness_histogram"] == {"0": 6, "2": 1}
    # a float64 mean of 7 factors: ~7 roundings of 2^-53, inside approx's default rel 1e-6
    assert metrics["mean_lr_factor"] == pytest.approx((6 + 1 / 3) / 7)
    assert metrics["backup_workers"] == 1


def test_constant_policy_folds_late_pushes_at_full_weight():
    server = backup_server(staleness_lr="constant")
    push(server, 0, 0.0)
    push(server, 2, 0.0)
    push(server, 0, 0.0)
    push(server, 2, 0.0)
    push(server, 1, 3.0, pulled=0)
    push(server, 0, 0.0)
    push(server, 2, 0.0)
    # (3 + 0 + 0) / 3: small integers and one division, a rounding of 2^-24 at most in
    # float32, inside approx's default rel 1e-6
    assert weight(server) == pytest.approx([-1.0] * 3)


def test_a_retired_worker_lowers_the_quorum_and_a_late_round_ends_with_the_last_worker():
    server = backup_server()
    push(server, 0, 4.0)
    server._retire(2, lost=None)  # two live workers, one backup: one fresh push suffices
    assert (server.version, weight(server)) == (1, [-4.0] * 3)
    push(server, 1, 2.0, pulled=0)  # late, and nobody fresh will come after the others go
    server._retire(0, lost=None)
    assert server.version == 1
    server._retire(1, lost=None)
    assert (server.version, weight(server)) == (2, [-6.0] * 3)


def test_without_backup_workers_the_round_still_waits_for_everyone():
    server = shard_server(staleness=0, workers=3)
    push(server, 0, 1.0)
    push(server, 2, 1.0)
    assert server.version == 0 and not server._may_pull(0)
    push(server, 1, 4.0)
    assert (server.version, weight(server)) == (1, [-2.0] * 3)
