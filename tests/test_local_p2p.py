"""Shared-memory point-to-point messages between two workers on one host (``local_p2p``),
and the receive buffers a pipeline link reuses (``receive_buffers``).

Messages are bytes copied, so every comparison is exact (``torch.equal``)."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import time

import pytest
import torch

import paratrain
from paratrain.parallel.pipeline.receive_buffers import ReceiveBuffers
from paratrain.runtime.local_p2p import PeerProcess
from paratrain.runtime.shm_ring import supported
from tests import local_p2p_workers as workers
from tests.local_p2p_workers import sample_messages

NEEDS_PROC = pytest.mark.skipif(
    not os.path.exists("/proc/self/stat"), reason="a peer's process is watched through /proc"
)
pytestmark = pytest.mark.skipif(
    not supported(), reason="the shared-memory ring is offered on x86-64 only"
)


@pytest.mark.parametrize("mode", ["posted-first", "came-first", "sender-blocked"])
@pytest.mark.parametrize("capacity", [1 << 20, 64 << 10], ids=["ring-1MiB", "ring-64KiB"])
def test_messages_arrive_exact_by_tag_in_any_order(capacity, mode):
    """Sent in one order, received in another, posted before they come or after, or
    while the sender sits in a collective; the 600 KB message crosses the 64 KiB ring in
    frames of a quarter of it."""
    results = paratrain.launch(workers.out_of_order_worker, devices=2, args=(capacity, mode))
    got = results[1]["got"]
    for tag, value in sample_messages().items():
        assert got[tag].dtype == value.dtype and torch.equal(got[tag], value), tag
    assert results[0]["covered"] and results[1]["covered"]


def test_a_message_waiting_in_the_ring_goes_straight_into_the_receive_posted_for_it():
    """A sender often runs ahead of its receiver: the receive posted after its message
    came takes it from the ring into its own buffer, not through a buffer kept aside."""
    result = paratrain.launch(workers.waiting_in_ring_worker, devices=2)[1]
    assert result == {"done": True, "kept_aside": False, "exact": True}


@NEEDS_PROC
def test_a_wait_on_a_peer_whose_process_ended_says_so_without_waiting_out_the_timeout(tmp_path):
    """gloo's socket fails at once when its peer ends; a ring cannot tell, so the wait
    looks at the peer's process (timeout 30 s here: without the look, it waits them out)."""
    context = multiprocessing.get_context("spawn")
    init, out = str(tmp_path / "init"), str(tmp_path / "out.json")
    ranks = [
        context.Process(target=workers.ending_peer_process, args=(rank, init, out))
        for rank in range(2)
    ]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(90)
        if process.is_alive():
            process.kill()
    found = json.loads((tmp_path / "out.json").read_text())
    assert found["covered"]
    assert found["raised"].startswith("PeerProcessEnded: receive of tag 1 from rank 0 failed")
    assert "rank 0's process" in found["raised"]
    assert found["seconds"] < 10


@NEEDS_PROC
def test_a_peer_process_reads_as_ended_once_gone_a_zombie_or_its_number_reused():
    child = subprocess.Popen(["sleep", "60"])
    try:
        with open(f"/proc/{child.pid}/stat") as file:
            started = file.read().rpartition(")")[2].split()[19]
        watched = PeerProcess(child.pid, started)
        assert not watched.ended()
        assert PeerProcess(child.pid, started + "0").ended()  # another process, that number
        child.kill()
        deadline = time.monotonic() + 10
        while not watched.ended() and time.monotonic() < deadline:  # a zombie, not reaped
            time.sleep(0.01)
        assert watched.ended()
    finally:
        child.kill()
        child.wait()
    assert watched.ended()  # reaped: no entry at all


@NEEDS_PROC
def test_a_peer_in_another_process_namespace_is_not_watched():
    """Its number would name another process here; the timeout stays the bound."""
    mine = PeerProcess.identity()
    assert mine is not None and PeerProcess.watch(mine, mine) is not None
    assert not PeerProcess.watch(mine, mine).ended()
    assert PeerProcess.watch({**mine, "namespace": "pid:[1]"}, mine) is None
    assert PeerProcess.watch(None, mine) is None
    assert PeerProcess.watch(mine, None) is None  # this process cannot say its own


def test_sends_never_block_and_two_waiting_sides_move_each_others_messages():
    """Each side queues six messages of the ring's whole size before posting a receive:
    the sends return at once (what fits is copied, the rest waits), and the waits, which
    move both ways, complete with every value where it belongs."""
    capacity, count = 64 << 10, 6
    results = paratrain.launch(workers.both_ways_worker, devices=2, args=(capacity, count))
    for rank, result in enumerate(results):
        peer = 1 - rank
        assert result["values"] == [[float(peer * 100 + i)] for i in range(count)]
        assert result["queued_s"] < 5.0  # not a wait for the peer (the timeout is 60 s)


def test_a_message_that_never_comes_times_out_with_a_sentence():
    results = paratrain.launch(workers.timeout_worker, devices=2)
    assert "receive of tag 9 from rank 0 timed out after 1 s" in results[1]


@pytest.mark.parametrize(
    ("other_host", "full"),
    [(None, None), (0, None), (1, None), (None, 0)],
    ids=["same-host", "rank0-away", "rank1-away", "rank0-no-room"],
)
def test_a_pair_uses_shared_memory_only_when_both_sides_agree_and_leaves_no_file(other_host, full):
    """Both sides reach the same answer; on one host, a pair that keeps gloo says why
    (a pair on two hosts keeps it silently: that is what gloo is for)."""
    results = paratrain.launch(workers.agreement_worker, devices=2, args=(other_host, full))
    same = other_host is None and full is None
    assert [r["covered"] for r in results] == [same] * 2
    assert [r["left"] for r in results] == [[], []]
    if full is None:
        assert [r["warned"] for r in results] == [[], []]
    else:
        for result in results:
            (warning,) = result["warned"]
            assert "share a host but keep gloo" in warning
            assert "No space left on device" in warning


@pytest.mark.parametrize("setting", [None, "gloo"])
def test_a_cpu_pipelines_links_use_shared_memory_unless_told_gloo(monkeypatch, setting):
    if setting:
        monkeypatch.setenv("PARATRAIN_P2P", setting)
    results = paratrain.launch(workers.link_transport_worker, devices=2)
    assert [r["shared"] for r in results] == [[setting is None] * 2] * 2


def test_a_receive_buffer_is_reused_only_once_nothing_holds_it():
    """Held by autograd's saved input, or by a view, a buffer is not handed out again;
    once nothing holds it, it is; shapes a round did not use are dropped."""
    buffers = ReceiveBuffers(torch.device("cpu"))
    if not buffers.reusing:
        pytest.skip("this torch has no storage use count (torch._C._storage_Use_Count)")
    shape = (4, 3)
    x, raw = buffers.take(shape, torch.float32)
    assert raw.dtype == torch.uint8 and raw.numel() == 48
    first = x.data_ptr()
    x.requires_grad_(True)
    graph = (x * x).sum()  # keeps x for the backward
    del x
    y, _ = buffers.take(shape, torch.float32)
    assert y.data_ptr() != first
    second = y.data_ptr()
    del graph
    z, _ = buffers.take(shape, torch.float32)
    assert z.data_ptr() == first  # free again once the graph is gone
    view = z[1:]
    del z, y
    w, _ = buffers.take(shape, torch.float32)
    assert w.data_ptr() == second  # the first is still held by the view
    assert buffers.idle_bytes() == 0
    del view, w
    assert buffers.idle_bytes() == 2 * 48
    buffers.new_round()  # the round used the shape: kept
    assert buffers.idle_bytes() == 2 * 48
    buffers.new_round()  # the next one did not: dropped
    assert buffers.idle_bytes() == 0


def test_a_dropped_set_of_connections_is_freed_with_its_pipes():
    """Whatever the pusher thread wrote for it, a set of connections whose engine is gone
    is garbage like any object: its rings unmapped, its pipes closed."""
    results = paratrain.launch(workers.dropped_worker, devices=2)
    assert results == [{"freed": True, "open": []}] * 2


def test_an_unknown_transport_is_refused_in_one_sentence(monkeypatch):
    monkeypatch.setenv("PARATRAIN_P2P", "shm")
    with pytest.raises(paratrain.WorkerError, match="PARATRAIN_P2P='shm' names no transport"):
        paratrain.launch(workers.link_transport_worker, devices=2)
