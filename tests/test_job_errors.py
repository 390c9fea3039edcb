"""``cli.job_errors.say_error_once``: rank 0 says a refusal at once; another rank of a
torchrun job waits for rank 0 to say it, and says it itself, with its rank, if it outlives
the wait (an error rank 0 did not meet). The torchrun run of both is in test_torchrun."""

from __future__ import annotations

import pytest

from paratrain.cli import job_errors


@pytest.fixture
def sleeps(monkeypatch) -> list[float]:
    waited: list[float] = []
    monkeypatch.setattr(job_errors.time, "sleep", waited.append)
    return waited


def _in_job(monkeypatch, rank: int) -> None:
    monkeypatch.delenv("PARATRAIN_LAUNCHED_WORKER", raising=False)
    for name, value in {"RANK": rank, "WORLD_SIZE": 2, "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, str(value))


def test_rank_0_says_it_at_once(monkeypatch, capsys, sleeps):
    _in_job(monkeypatch, 0)
    job_errors.say_error_once("use --devices 2.")
    assert capsys.readouterr().err == "paratrain: error: use --devices 2.\n"
    assert sleeps == []


def test_outside_a_job_it_is_said_at_once(monkeypatch, capsys, sleeps):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    job_errors.say_error_once("use --devices 2.")
    assert capsys.readouterr().err == "paratrain: error: use --devices 2.\n"
    assert sleeps == []


def test_another_rank_waits_for_rank_0_then_says_it_with_its_rank(monkeypatch, capsys, sleeps):
    _in_job(monkeypatch, 1)
    job_errors.say_error_once("no file data.bin on this node.")
    assert sleeps == [job_errors.RANK_ZERO_GRACE_S]
    assert capsys.readouterr().err == "paratrain: error (rank 1): no file data.bin on this node.\n"
