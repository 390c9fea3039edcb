"""memory_per_device: a worker over budget fails with one sentence that says what fits.

Checked three ways: at setup (parameters alone), on the first step inside a dp job
(optimizer state, the message naming a strategy the ZeRO arithmetic says would fit), and
from the command line (refused before workers start where the parameter count already
says so; otherwise the worker's sentence, and per-worker memory in the summary and the
metrics file).
"""

from __future__ import annotations

import re

import pytest

import paratrain
from paratrain.models import build_model, count_parameters
from paratrain.parallel import strategy_names
from paratrain.parallel.fit_advice import fitting_strategy
from paratrain.reports.metrics_file import read_metrics
from paratrain.runtime.ledger import DeviceOutOfMemory
from paratrain.runtime.units import format_bytes
from tests import workers
from tests.test_cli_train import run_cli

MID_MLP = count_parameters(build_model("mlp", in_features=64, hidden=256, depth=2, classes=8))
SMALL_RUN = [
    "--model", "mlp", "--dataset", "synthetic", "--devices", "2", "--global-batch", "32",
    "--hidden", "64", "--depth", "1", "--eval-every", "0",
]  # fmt: skip
SMALL_MLP = count_parameters(build_model("mlp", in_features=784, hidden=64, depth=1, classes=10))


def test_setup_refuses_parameters_over_the_budget():
    with pytest.raises(DeviceOutOfMemory) as caught:
        workers.parity_engine("single", "gpt", "adam", memory_per_device="16KiB")
    error = caught.value
    assert error.category == "parameters" and error.worker == 0 and error.budget == 16 * 1024
    assert str(error).startswith("worker 0 is out of memory: its parameters reached 27.2 KiB")
    assert "no strategy fits" in str(error)  # one worker: sharding cannot help


def test_bad_sizes_are_refused_at_setup():
    with pytest.raises(ValueError, match="memory_per_device must be a size such as '2GiB'"):
        workers.parity_engine("single", "mlp", "sgd", memory_per_device="lots")


@pytest.mark.slow
def test_dp_optimizer_state_overflow_names_worker_category_and_a_strategy_that_fits():
    """16 B/param does not fit 13.5 B/param; 4 + 4 + 8/2 = 12 B/param (zero1) would."""
    budget = int(13.5 * MID_MLP)
    expected = fitting_strategy(
        parameters=MID_MLP, workers=2, budget=budget, candidates=strategy_names(), exclude=["dp"]
    )
    with pytest.raises(paratrain.WorkerError) as caught:
        paratrain.launch(
            workers.model_state_after_one_step,
            devices=2,
            args=("dp", {"memory_per_device": budget}),
        )
    details = caught.value.details
    assert re.search(r"worker [01] is out of memory: its optimizer state reached 660 KiB", details)
    assert f"over the {format_bytes(budget)} budget set by memory_per_device" in details
    assert f"strategy {expected!r} would fit ({MID_MLP:,} fp32 parameters" in details


def test_cli_refuses_a_budget_the_parameters_exceed_before_workers_start(tmp_path, capsys):
    code, _, err = run_cli(
        capsys, *SMALL_RUN, "--memory-per-device", "100KiB", "--run-dir", str(tmp_path / "r")
    )
    assert code == 2
    assert err.startswith(
        "paratrain: error: the parameters alone need 199 KiB per worker under strategy 'dp', "
        "over --memory-per-device 100 KiB; no strategy fits"
    )
    assert err.count("\n") == 1 and not (tmp_path / "r" / "metrics.jsonl").exists()


def test_cli_refuses_a_malformed_size(tmp_path, capsys):
    code, _, err = run_cli(capsys, *SMALL_RUN, "--memory-per-device", "2G")
    assert code == 2 and "memory_per_device must be a size such as '2GiB'" in err


@pytest.mark.slow
def test_cli_worker_over_budget_prints_its_one_sentence(tmp_path, capsys):
    budget = 4 * SMALL_MLP * 2 + 20 * 1024  # parameters and gradients, then little room
    code, _, err = run_cli(
        capsys, *SMALL_RUN, "--steps", "3", "--memory-per-device", str(budget),
        "--run-dir", str(tmp_path / "r"),
    )  # fmt: skip
    assert code == 1
    assert re.fullmatch(r"paratrain: worker [01] is out of memory: its \S.*\.\n", err), err


@pytest.mark.slow
def test_cli_summary_and_metrics_show_each_workers_memory(tmp_path, capsys):
    run_dir = tmp_path / "r"
    code, out, err = run_cli(
        capsys, *SMALL_RUN, "--steps", "4", "--log-every", "2", "--memory-per-device", "8MiB",
        "--precision", "bf16", "--recompute", "--run-dir", str(run_dir),
    )  # fmt: skip
    assert code == 0, err
    assert "precision         bf16" in out and "memory budget     8 MiB per worker" in out
    assert re.search(r"ledger peak\s+worker 0: .*, worker 1: ", out)
    records = read_metrics(run_dir / "metrics.jsonl")
    memory = [r for r in records if r["kind"] == "memory"]
    assert [r["worker"] for r in memory] == [0, 1]
    for record in memory:
        assert record["budget"] == 8 * 1024**2
        assert record["current"]["parameters"] == 4 * SMALL_MLP
        assert record["peak"]["activations"] > 0 and record["peak"]["communication"] == 8
        assert record["peak_total"] <= record["budget"]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["skipped_steps"] for r in train] == [0, 0]
