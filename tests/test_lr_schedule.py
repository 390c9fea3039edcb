"""Learning-rate schedules: a torch scheduler on engine.optimizer under every engine (the
ps servers follow the worker's rates), and --lr-schedule/--warmup-steps on the command line."""

from __future__ import annotations

import pytest

import paratrain
from paratrain.config import ConfigError, TrainConfig
from paratrain.run.lr_schedule import lr_factor
from tests import schedule_workers
from tests.test_parity_dp import TOLERANCE, relative_error


def test_warmup_then_cosine_and_linear():
    cosine = [lr_factor("cosine", s, total_steps=10, warmup_steps=2) for s in range(1, 11)]
    # float64 formulas: cos(pi) + 1 leaves ~1e-16, hence abs 1e-12 at zero and approx's
    # default rel 1e-6 elsewhere (a wrong formula is off by O(0.1)).
    assert cosine[:2] == [0.5, 1.0] and cosine[-1] == pytest.approx(0.0, abs=1e-12)
    assert cosine[5] == pytest.approx(0.5)  # halfway through the 8 decay steps
    assert lr_factor("linear", 6, total_steps=10, warmup_steps=2) == pytest.approx(0.5)
    assert lr_factor("constant", 7, total_steps=10, warmup_steps=2) == 1.0
    with pytest.raises(ConfigError, match="lr_schedule must be one of constant, cosine"):
        TrainConfig(lr_schedule="step")


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_scheduler_drives_every_engine_as_it_drives_one_device(optimizer):
    """Every engine, the pipeline (one optimizer per stage) and synchronous ps (the servers
    take the rates the worker's optimizer has) included."""
    reference, reference_losses = schedule_workers.train_scheduled("single", optimizer)
    runs = [
        ("dp", optimizer, {}),
        ("zero1", optimizer, {}),
        ("zero2", optimizer, {}),
        ("zero3", optimizer, {}),
        ("pipeline", optimizer, {"stages": 2, "micro_batches": 2}),
        ("ps", optimizer, {"staleness": 0}),
    ]
    results = paratrain.launch(schedule_workers.train_all, devices=2, args=(runs,))
    for (strategy, _, _), (state, losses) in zip(runs, results[0], strict=True):
        error = relative_error(state, reference)
        assert error <= TOLERANCE, (strategy, error)
        assert losses == pytest.approx(reference_losses, rel=TOLERANCE), strategy


@pytest.mark.slow
def test_the_command_line_warms_up_and_decays(tmp_path, capsys):
    """Rates logged at every step follow warmup then cosine, under ps (whose servers follow)."""
    from paratrain.reports.metrics_file import read_metrics
    from tests.test_cli_train import run_cli

    run_dir = tmp_path / "run"
    args = ["--model", "mlp", "--dataset", "synthetic", "--devices", "2", "--steps", "6"]
    args += ["--global-batch", "16", "--log-every", "1", "--eval-every", "0", "--lr", "0.1"]
    args += ["--strategy", "ps", "--lr-schedule", "cosine", "--warmup-steps", "2"]
    code, _, err = run_cli(capsys, *args, "--run-dir", str(run_dir))
    assert code == 0, err
    rates = [r["lr"] for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    expected = [0.1 * lr_factor("cosine", s, total_steps=6, warmup_steps=2) for s in range(1, 7)]
    # The same float64 formula on both sides, logged through JSON (which round-trips a
    # float64 exactly): exact in principle, 1e-12 allows float64 noise only.
    assert rates == pytest.approx(expected, rel=1e-12)
