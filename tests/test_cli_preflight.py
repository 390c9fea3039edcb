"""Refusals that need no data (unknown dataset, NCCL without GPUs) come before any folder
is created, in the one line an unknown ``--model`` gets; more CPU workers than cores get
one warning line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from paratrain.checkpoints.format import save_model_state
from paratrain.cli import main
from paratrain.config import TrainConfig, as_dict
from paratrain.models import build_model
from paratrain.run.preflight import time_sharing_warning


@pytest.fixture(autouse=True)
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs create ``runs/`` in the cwd and downloads a cache: both point into tmp_path."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("PARATRAIN_DATA", raising=False)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "resnet"], "unknown model 'resnet'; choose one of mlp, lenet, gpt."),
        (
            ["--dataset", "cifar10"],
            "unknown dataset 'cifar10'; choose one of shakespeare, fashion_mnist, synthetic, "
            "synthetic_images, synthetic_tokens.",
        ),
        (["--backend", "mpi"], "unknown backend 'mpi'; choose one of auto, gloo, nccl."),
        (
            ["--backend", "nccl", "--devices", "2"],
            "--backend nccl needs one GPU per worker, but 2 worker(s) were asked for and "
            "0 GPU(s) are visible; pass --backend gloo (CPU workers) or --backend auto.",
        ),
    ],
)
def test_refused_in_one_line_before_any_folder(tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a CPU machine
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    code = main(["train", "--no-progress", "--steps", "1", *args])
    assert code == 2
    assert capsys.readouterr().err == f"paratrain: error: {message}\n"
    assert sorted(path.name for path in tmp_path.iterdir()) == []  # no runs/, no cache/


def test_more_cpu_workers_than_cores_warn_once_that_they_time_share(monkeypatch, capsys):
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code = main(
        ["train", "--no-progress", "--model", "mlp", "--dataset", "synthetic", "--devices", "2",
         "--steps", "1", "--global-batch", "4", "--hidden", "8", "--depth", "1",
         "--eval-every", "0", "--backend", "gloo"]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("paratrain: warning:")]
    assert warnings == [
        "paratrain: warning: --devices 2 starts 2 CPU workers on 1 core(s); the workers will "
        "time-share the cores, so steps run slower than with --devices 1 (the results are "
        "the same)."
    ]


def test_no_warning_within_the_cores(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = TrainConfig(model="mlp", dataset="synthetic", backend="gloo")
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert time_sharing_warning(config, 2) is None
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert "time-share" in time_sharing_warning(config, 2)


def test_a_refused_run_says_only_why(tmp_path, monkeypatch, capsys):
    """Beyond the cores, a run refused in the parent (here a damaged checkpoint to resume)
    prints its one sentence without the warning above it, which is for runs that run."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    settings = {"model": "mlp", "dataset": "synthetic", "hidden": 8, "depth": 1, "devices": 2}
    torch.manual_seed(0)
    model = build_model("mlp", in_features=784, hidden=8, depth=1, classes=10)
    saved = save_model_state(
        tmp_path / "run" / "final",
        model.state_dict(),
        metadata={"config": as_dict(TrainConfig(**settings))},
    )
    shard = saved / "model-0.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1] + b"x")
    assert main(["train", "--resume", str(tmp_path / "run"), "--steps", "5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is damaged or was changed after saving" in err, err
    assert main(["train", "--model", "lenet", "--dataset", "synthetic", "--devices", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs image-shaped inputs" in err, err
