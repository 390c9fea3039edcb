"""A resume reproduces every figure of the uninterrupted run, and says what it changes
(issue 24, items 9 and 10)."""

from __future__ import annotations

from pathlib import Path

import pytest

from paratrain.cli import main
from paratrain.config import TrainConfig
from paratrain.reports.metrics_file import read_metrics
from paratrain.run.length import RunLength
from paratrain.run.schedule_notice import schedule_change

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
    "--log-every",
    "1",
]


def eval_losses(run_dir: Path) -> dict[int, float]:
    records = read_metrics(run_dir / "metrics.jsonl")
    return {r["step"]: r["eval_loss"] for r in records if r.get("kind") == "eval"}


@pytest.mark.slow
def test_a_resumed_run_evaluates_the_same_batches_as_the_uninterrupted_one(tmp_path):
    """Every evaluation reads the next batch of a cycling eval loader (16 batches in the
    synthetic test split, one per evaluation), so after a resume at step 4 the evaluations
    at steps 6 and 8 must read batches 2 and 3, as the uninterrupted run does, not 0 and 1
    again. Same layout, same bits, same ops: the losses are equal exactly (the train
    losses and weights of such a resume already were)."""
    flags = ["--eval-every", "2", "--eval-batches", "1"]
    whole = tmp_path / "whole"
    assert main([*BASE, *flags, "--steps", "8", "--run-dir", str(whole)]) == 0
    part = tmp_path / "part"
    assert main([*BASE, *flags, "--steps", "4", "--run-dir", str(part)]) == 0
    assert main([*BASE, *flags, "--resume", str(part), "--steps", "8"]) == 0
    expected = eval_losses(whole)
    assert sorted(expected) == [2, 4, 6, 8]
    assert eval_losses(part) == expected


def test_extending_a_finished_cosine_run_says_where_the_lr_goes():
    """A Lightning or DeepSpeed user extends a run by raising its length on resume and
    expects it to go on (neither refuses it); here the schedule is a function of the step
    and the run's length, so the cosine curve is redrawn over the new length and a rate
    that had reached 0 starts again above 0. That is allowed, and said in the resume
    line, with both rates, so that no one meets it in a plot."""
    saved = {"lr_schedule": "cosine", "lr": 3e-3, "steps": 30, "warmup_steps": 0}
    config = TrainConfig(model="mlp", dataset="synthetic", lr_schedule="cosine", steps=60)
    clause = schedule_change(saved, 30, config, RunLength(60, 128), 4096)
    # 3e-3 * 0.5 * (1 + cos(pi * 31 / 60)) = 1.42e-3 at step 31
    assert clause == (
        "the lr schedule (cosine, 60 steps) differs from the saved run's (cosine, 30 steps): "
        "the lr was 0 at step 30 and is 0.00142 at step 31"
    )


def test_a_resume_that_keeps_the_schedule_says_nothing_of_it():
    """A SIGTERM resume (same length, same schedule) continues the curve it was on."""
    saved = {"lr_schedule": "cosine", "lr": 3e-3, "steps": 30, "warmup_steps": 0}
    config = TrainConfig(model="mlp", dataset="synthetic", lr_schedule="cosine", steps=30)
    assert schedule_change(saved, 12, config, RunLength(30, 128), 4096) is None
    constant = {**saved, "lr_schedule": "constant"}
    longer = TrainConfig(model="mlp", dataset="synthetic", steps=60)
    assert schedule_change(constant, 30, longer, RunLength(60, 128), 4096) is None


@pytest.mark.slow
def test_the_resume_line_carries_the_schedule_change(tmp_path, capsys):
    run = tmp_path / "cosine"
    flags = ["--eval-every", "0", "--lr-schedule", "cosine"]
    assert main([*BASE, *flags, "--steps", "3", "--run-dir", str(run)]) == 0
    capsys.readouterr()
    assert main([*BASE, "--resume", str(run), "--steps", "6"]) == 0
    # 3e-3 * 0.5 * (1 + cos(pi * 4 / 6)) = 7.5e-4
    assert (
        "; the lr schedule (cosine, 6 steps) differs from the saved run's (cosine, 3 steps): "
        "the lr was 0 at step 3 and is 0.00075 at step 4\n"
    ) in capsys.readouterr().err
