"""paratrain.launch: results come back in rank order, failures stop everyone."""

from __future__ import annotations

import os
import time

import pytest
import torch

import paratrain
from paratrain.runtime.launch import _root_cause, resolve_backend
from tests import workers


def test_results_in_rank_order_with_tensors_intact():
    results = paratrain.launch(workers.rank_and_tensor, devices=3, args=(2.0,))
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["world"] == 3 for r in results)
    assert len({r["pid"] for r in results}) == 3
    for rank, result in enumerate(results):
        expected = torch.arange(4, dtype=torch.float64) * 2.0 + rank
        assert result["tensor"].dtype == torch.float64
        assert torch.equal(result["tensor"], expected)
    cores = os.cpu_count() or 1
    assert all(r["threads"] == max(1, cores // 3) for r in results)


def test_failing_worker_stops_the_others_and_reports_its_traceback():
    start = time.monotonic()
    with pytest.raises(paratrain.WorkerError) as caught:
        paratrain.launch(workers.fail_on_rank_one, devices=3, args=("boom from rank one",))
    elapsed = time.monotonic() - start
    assert caught.value.rank == 1
    assert "boom from rank one" in str(caught.value)
    assert "ValueError" in caught.value.details
    assert "fail_on_rank_one" in caught.value.details  # the original traceback
    assert elapsed < 30, f"the others were not stopped promptly ({elapsed:.1f}s)"


def test_killed_worker_is_named():
    with pytest.raises(paratrain.WorkerError) as caught:
        paratrain.launch(workers.killed_rank_one, devices=2)
    assert caught.value.rank == 1
    assert "SIGKILL" in str(caught.value)


def test_no_worker_left_behind(tmp_path):
    with pytest.raises(paratrain.WorkerError):
        paratrain.launch(workers.write_pid_then_fail, devices=3, args=(str(tmp_path),))
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert len(pids) == 3
    for pid in pids:
        assert not _alive(pid), f"worker pid {pid} outlived the launch"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); read its state.
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_bad_arguments_are_refused_before_any_worker_starts():
    with pytest.raises(ValueError, match="devices must be a positive integer"):
        paratrain.launch(workers.rank_and_tensor, devices=0)
    with pytest.raises(ValueError, match="backend must be"):
        resolve_backend("mpi", 2)


def test_root_cause_prefers_the_non_communication_error():
    failures = {
        0: "Traceback...\nRuntimeError: [gloo] Connection closed by peer",
        2: "Traceback...\nValueError: bad shape",
    }
    assert _root_cause(failures) == 2
    assert _root_cause({1: "gloo: x", 3: "gloo: y"}) == 1
    ended = "paratrain.runtime.local_p2p.PeerProcessEnded: rank 1's process (7) ended"
    assert _root_cause({0: f"Traceback...\n{ended}", 1: "Traceback...\nValueError: x"}) == 1


def test_inside_torchrun_runs_in_this_process(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    try:
        value = paratrain.launch(lambda x: (os.getpid(), dist.get_world_size(), x), args=(7,))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # One contract in both launch modes: a list in rank order (see runtime/external_job).
    assert value == [(os.getpid(), 1, 7)]


def test_inside_torchrun_a_device_count_other_than_the_jobs_is_refused(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(ValueError, match=r"devices=4 .* torchrun job of 2 processes"):
        paratrain.launch(lambda: None, devices=4)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
