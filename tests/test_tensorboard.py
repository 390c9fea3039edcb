"""``--tensorboard``: the train and eval records of metrics.jsonl, as TensorBoard scalars
at their steps, continued by a resumed run; refused before launch without the package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from paratrain.cli import main
from paratrain.reports.metrics_file import read_metrics
from paratrain.reports.tensorboard_log import tensorboard_dir

pytest.importorskip("tensorboard", reason="--tensorboard writes through the tensorboard package")
from tensorboard.backend.event_processing.event_accumulator import (  # noqa: E402
    EventAccumulator,
)

FLOAT32_RELATIVE = 2.0**-24
"""Event files store scalars as float32; metrics.jsonl keeps the float64 figure, so the
two agree to float32's rounding (half an ulp, 2^-24 relative) and no further."""

TAGS = {"loss": "loss", "eval_loss": "loss", "accuracy": "accuracy"}
TAGS["samples_per_s"] = "samples_per_s"
"""A record's field -> its tag's name after the kind (``eval_loss`` is ``eval/loss``)."""

RUN = ["train", "--no-progress", "--model", "mlp", "--dataset", "synthetic", "--hidden", "8"]
RUN += ["--depth", "1", "--devices", "2", "--global-batch", "8", "--eval-every", "2"]
RUN += ["--eval-batches", "1", "--log-every", "1", "--backend", "gloo", "--tensorboard"]


@pytest.fixture(autouse=True)
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """Every scalar series of the run's event files: tag -> {step: value}."""
    events = EventAccumulator(str(tensorboard_dir(run_dir)))
    events.Reload()
    return {
        tag: {event.step: event.value for event in events.Scalars(tag)}
        for tag in events.Tags()["scalars"]
    }


def records(run_dir: Path, kind: str) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == kind]


@pytest.mark.slow
def test_train_and_eval_records_become_scalars_and_a_resume_continues_them(tmp_path):
    run_dir = tmp_path / "run"
    assert main([*RUN, "--steps", "4", "--run-dir", str(run_dir)]) == 0
    assert main(["train", "--no-progress", "--resume", str(run_dir), "--steps", "6",
                 "--tensorboard", "--devices", "2", "--backend", "gloo"]) == 0  # fmt: skip
    series = scalars(run_dir)
    train, evals = records(run_dir, "train"), records(run_dir, "eval")
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert sorted(series["train/loss"]) == [1, 2, 3, 4, 5, 6]  # the resume continued it
    assert sorted(series["eval/loss"]) == [r["step"] for r in evals] == [2, 4, 6]
    for kind, rows in (("train", train), ("eval", evals)):
        for row in rows:
            for field, tag in TAGS.items():
                if field in row:
                    value = series[f"{kind}/{tag}"][row["step"]]
                    assert value == pytest.approx(row[field], rel=FLOAT32_RELATIVE, abs=0)
    assert {"train/accuracy", "eval/accuracy"} <= set(series)  # synthetic classifies


def test_without_the_package_it_is_refused_before_any_folder(tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name)
    )
    assert main([*RUN, "--steps", "1"]) == 2
    assert capsys.readouterr().err == (
        "paratrain: error: --tensorboard needs the tensorboard package; install it with "
        "`pip install tensorboard` or drop --tensorboard.\n"
    )
    assert sorted(path.name for path in tmp_path.iterdir()) == []
