"""Resume, periodic checkpoints, restarts after a killed worker, and the ckpt command."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from paratrain.checkpoints.format import Checkpoint, load_model_state
from paratrain.cli import main
from tests.test_parity_dp import TOLERANCE, relative_error

BASE = [
    "train",
    "--no-progress",
    "--model",
    "mlp",
    "--dataset",
    "synthetic",
    "--hidden",
    "32",
    "--depth",
    "1",
    "--global-batch",
    "32",
    "--eval-every",
    "0",
    "--devices",
    "2",
    "--log-every",
    "1",
]


def train(tmp_path: Path, name: str, *flags: str) -> Path:
    run_dir = tmp_path / name
    assert main([*BASE, "--run-dir", str(run_dir), *flags]) == 0
    return run_dir


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    run_dir = train(tmp_path_factory.mktemp("runs"), "whole", "--steps", "12")
    return load_model_state(run_dir / "final")


@pytest.mark.slow
def test_resume_continues_exactly_where_the_run_stopped(tmp_path, uninterrupted, capsys):
    first = train(tmp_path, "part", "--steps", "7", "--checkpoint-every", "3")
    assert Checkpoint(first / "final").step == 7
    assert main([*BASE, "--resume", str(first), "--steps", "12"]) == 0  # into the same run dir
    resumed = load_model_state(first / "final")
    # Exact in principle: the resumed run loads the same bits and runs the same ops in the
    # same order on the same layout; 1e-6 (16 fp32 unit roundoffs) allows nothing beyond
    # rounding, a tenth of the parity bar that a change of layout gets (below).
    assert relative_error(resumed, uninterrupted) <= 1e-6
    capsys.readouterr()


@pytest.mark.slow
def test_resume_at_another_device_count_and_strategy(tmp_path, uninterrupted):
    first = train(tmp_path, "part", "--steps", "6")
    second = tmp_path / "second"
    flags = ["--resume", str(first / "final"), "--steps", "12", "--run-dir", str(second)]
    flags += ["--strategy", "pipeline", "--stages", "2", "--micro-batches", "2"]
    assert main([*BASE, *flags]) == 0
    # Another strategy reduces in another order: the parity bar.
    assert relative_error(load_model_state(second / "final"), uninterrupted) <= TOLERANCE


@pytest.mark.slow
def test_periodic_checkpoints_keep_the_newest_k(tmp_path):
    run_dir = train(
        tmp_path, "keep", "--steps", "10", "--checkpoint-every", "2", "--keep-checkpoints", "2"
    )
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert kept == ["step-00000006", "step-00000008"]


@pytest.mark.slow
def test_killed_worker_stops_the_run_and_names_itself(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PARATRAIN_FAULT", "kill:1:4")
    code = main([*BASE, "--steps", "8", "--run-dir", str(tmp_path / "dead"), "--timeout", "30"])
    assert code == 1
    err = capsys.readouterr().err
    assert "worker 1 failed" in err and "killed by signal SIGKILL" in err


@pytest.mark.slow
def test_max_restarts_resumes_from_the_last_checkpoint_to_the_same_result(
    tmp_path, monkeypatch, uninterrupted, capsys
):
    monkeypatch.setenv("PARATRAIN_FAULT", "kill:1:8")
    run_dir = train(
        tmp_path,
        "restart",
        "--steps",
        "12",
        "--checkpoint-every",
        "3",
        "--max-restarts",
        "1",
        "--timeout",
        "30",
    )
    err = capsys.readouterr().err
    assert "worker 1 failed; restarting from checkpoint" in err and "step-00000006" in err
    assert "SIGKILL" in err
    # Exact in principle, as in the first test (same layout, same ops from the same bits).
    assert relative_error(load_model_state(run_dir / "final"), uninterrupted) <= 1e-6


@pytest.mark.slow
def test_ckpt_inspect_and_export(tmp_path, capsys):
    run_dir = train(tmp_path, "small", "--steps", "2")
    capsys.readouterr()
    assert main(["ckpt", "inspect", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "step 2, checksums verified" in out and "exp_avg x4" in out
    assert "strategy=dp, world_size=2" in out
    assert main(["ckpt", "export", str(run_dir), str(tmp_path / "model.safetensors")]) == 0
    assert main(["ckpt", "export", str(run_dir), str(tmp_path / "model.pt")]) == 0
    exported = load_file(str(tmp_path / "model.safetensors"))
    reference = load_model_state(run_dir / "final")
    assert exported.keys() == reference.keys()
    pickled = torch.load(tmp_path / "model.pt", weights_only=True)
    assert all(torch.equal(pickled[k], reference[k]) for k in reference)
    assert main(["ckpt", "export", str(run_dir), str(tmp_path / "model.txt")]) == 2


def test_resume_from_a_folder_without_checkpoints_is_refused(tmp_path, capsys):
    assert main([*BASE, "--resume", str(tmp_path), "--steps", "3"]) == 2
    assert "holds no checkpoint" in capsys.readouterr().err
