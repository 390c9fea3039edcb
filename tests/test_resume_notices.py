"""What a resume or a restart tells the operator (issue 24, item 11): a damaged newest
checkpoint is refused naming the older intact one to resume from, and a run that had to
restart says so in its summary."""

from __future__ import annotations

from pathlib import Path

import pytest

from paratrain.checkpoints.format import Checkpoint
from paratrain.checkpoints.locate import find_checkpoint
from paratrain.cli import main

BASE = [
    "train",
    "--no-progress",
    "--model",
    "mlp",
    "--dataset",
    "synthetic",
    "--hidden",
    "16",
    "--depth",
    "1",
    "--global-batch",
    "32",
    "--devices",
    "1",
    "--eval-every",
    "0",
    "--checkpoint-every",
    "2",
]


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_names_the_older_intact_one(tmp_path, capsys):
    run = tmp_path / "run"
    assert main([*BASE, "--steps", "4", "--run-dir", str(run)]) == 0
    newest = find_checkpoint(run)
    shard = next(newest.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit's worth of damage, same size
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    assert main([*BASE, "--resume", str(run), "--steps", "6"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is damaged or was changed after saving" in err, err
    older = Path(err.split("; resume from ")[1].removesuffix(" instead.\n"))
    assert older != newest and run in older.parents
    Checkpoint(older)  # intact: every checksum holds


@pytest.mark.slow
def test_the_summary_of_a_run_that_restarted_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PARATRAIN_FAULT", "kill:0:3")  # worker 0 dies at step 3, once
    run = tmp_path / "restart"
    flags = ["--steps", "4", "--max-restarts", "1", "--timeout", "30", "--run-dir", str(run)]
    assert main([*BASE, *flags]) == 0
    out = capsys.readouterr().out
    assert (
        "  restarted 1 time(s) from its last checkpoint after a failed worker (--max-restarts)\n"
        in out
    ), out
