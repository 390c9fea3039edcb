"""Lookahead pulls: exact numbers on tensors, on an in-process server, and through a
worker's shared-memory pull region."""

from __future__ import annotations

import pytest
import torch

from paratrain.parallel.ps import shared_memory
from paratrain.parallel.ps.lookahead import PullLookahead
from paratrain.parallel.ps.protocol import (
    LOOKAHEAD_FIELD,
    Op,
    encode_json,
    request_header,
)
from paratrain.parallel.ps.shared_memory import SharedRegion
from tests.test_ps_precision import push, shard_server, weight


def test_a_pull_is_exact_until_a_step_is_known_and_again_after_a_load():
    flat = torch.tensor([1.0, 2.0])
    look = PullLookahead([flat])
    look.note_push(0, 3)
    assert look.steps_ahead(0) == 0 and look.extrapolated(0) is None
    look.before_step()
    flat.sub_(0.5)  # the step: -0.5 everywhere
    assert look.steps_ahead(0) == 3 and look.steps_ahead(1) == 0, "worker 1 never pushed"
    # w + 3 * (w - before) = w - 1.5
    assert look.extrapolated(0)[0].tolist() == [-1.0, 0.0]
    look.forget_step()
    assert look.extrapolated(0) is None


def test_integer_parameters_are_copied_as_they_are():
    floats, counts = torch.tensor([4.0]), torch.tensor([7], dtype=torch.int64)
    look = PullLookahead([floats, counts])
    look.before_step()
    floats.add_(1.0)
    counts.add_(1)
    look.note_push(0, 2)
    ahead = look.extrapolated(0)
    assert ahead[0].tolist() == [7.0] and ahead[1].tolist() == [8]


def test_a_lagging_worker_pulls_where_the_parameters_are_heading():
    server = shard_server(staleness=None, lookahead=True)
    push(server, 0, 1.0)  # fresh, at the full rate: w = -1
    push(server, 1, 1.0, pulled=0)  # one update behind, at half the rate: w = -1.5
    # Worker 1 lags one step; the last step moved w by -0.5: it computes at -2.
    assert server._pull(1, for_step=True)[1].tolist() == [-2.0] * 3
    assert server._pull(1)[1].tolist() == [-1.5] * 3, "eval and state_dict read w as it is"
    assert server._pull(0, for_step=True)[1].tolist() == [-1.5] * 3, "worker 0 was fresh"
    assert weight(server) == [-1.5] * 3, "looking ahead never moves the parameters"
    assert server._metrics()["lookahead"] is True


def test_synchronous_and_switched_off_servers_never_look_ahead():
    assert shard_server(staleness=0, lookahead=True).lookahead is None
    server = shard_server(staleness=None, lookahead=False)
    push(server, 0, 1.0)
    push(server, 1, 1.0, pulled=0)
    assert server._pull(1, for_step=True)[1].tolist() == [-1.5] * 3
    assert server._metrics()["lookahead"] is False


def test_the_step_flag_travels_in_the_pull_header():
    assert request_header(Op.PULL, flags=1, lookahead=True)[LOOKAHEAD_FIELD] == 1.0
    assert request_header(Op.PULL, flags=1)[LOOKAHEAD_FIELD] == 0.0


@pytest.mark.skipif(
    not shared_memory.shared_memory_available(),
    reason=f"this host has no writable {shared_memory.SHARED_DIR}",
)
def test_a_lookahead_pull_is_written_into_a_shared_memory_workers_region():
    server = shard_server(staleness=None, lookahead=True)
    pull_region = SharedRegion.create(server.layout, "pull")
    push_region = SharedRegion.create(server.layout, "push")
    request = encode_json({"push": str(push_region.path), "pull": str(pull_region.path)})
    header = request_header(Op.ATTACH, flags=1, json_bytes=request.numel())
    server._process(1, Op.ATTACH, header, [request])
    pull_region.unlink()
    push_region.unlink()
    push(server, 0, 1.0)
    push(server, 1, 1.0, pulled=0)
    step_pull = request_header(Op.PULL, flags=1, lookahead=True)
    assert len(server._process(1, Op.PULL, step_pull, [])) == 1, "the header alone"
    assert pull_region.flats[0].tolist() == [-2.0] * 3
    server._process(1, Op.PULL, request_header(Op.PULL, flags=1), [])
    assert pull_region.flats[0].tolist() == [-1.5] * 3
    server._retire(1, lost=None)
