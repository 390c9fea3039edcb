"""``paratrain train`` end to end on local workers: metrics, checkpoint, summary, refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from paratrain.checkpoints.format import load_model_state
from paratrain.cli import main
from paratrain.models import build_model
from paratrain.reports.metrics_file import read_metrics

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["train", "--no-progress", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.slow
def test_train_mlp_on_two_workers_writes_metrics_and_a_loadable_checkpoint(tmp_path, capsys):
    run_dir = tmp_path / "run"
    code, out, err = run_cli(
        capsys,
        "--model",
        "mlp",
        "--dataset",
        "synthetic",
        "--devices",
        "2",
        "--steps",
        "40",
        "--global-batch",
        "64",
        "--lr",
        "0.003",
        "--eval-every",
        "20",
        "--log-every",
        "5",
        "--hidden",
        "64",
        "--depth",
        "1",
        "--run-dir",
        str(run_dir),
    )
    assert code == 0, err
    assert "strategy dp, 2 worker(s), 40 steps, global batch 64" in out
    assert "final eval loss" in out and "worker 1:" in out
    records = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(5, 45, 5))
    assert train[-1]["loss"] < 0.7 * train[0]["loss"], "training did not reduce the loss"
    assert [r["step"] for r in records if r["kind"] == "eval"] == [20, 40]
    assert records[0]["kind"] == "config" and records[0]["workers"] == 2
    state = load_model_state(run_dir / "final")
    model = build_model("mlp", in_features=784, hidden=64, depth=1, classes=10)
    model.load_state_dict(state)  # canonical names: no wrapper prefix
    assert all(not name.startswith("module.") for name in state)


@pytest.mark.slow
@pytest.mark.skipif(not SHARED_DATA.exists(), reason="../shared/data (tinyshakespeare) is absent")
def test_train_gpt_on_shakespeare_prints_a_sample(tmp_path, capsys):
    code, out, err = run_cli(
        capsys,
        "--model",
        "gpt",
        "--dataset",
        "shakespeare",
        "--data-dir",
        str(SHARED_DATA),
        "--devices",
        "2",
        "--steps",
        "6",
        "--global-batch",
        "8",
        "--n-layer",
        "1",
        "--n-embd",
        "32",
        "--block-size",
        "32",
        "--eval-every",
        "3",
        "--sample-chars",
        "40",
        "--run-dir",
        str(tmp_path / "gpt"),
    )
    assert code == 0, err
    assert "sample:" in out
    sample = out.split("sample:")[1]
    assert len(sample.strip()) > 0


def test_config_file_with_unknown_key_fails_before_workers_start(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text("stepz = 3\n")
    code, _, err = run_cli(capsys, "--config", str(path))
    assert code == 2
    assert "unknown key(s) stepz" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--global-batch", "30", "--devices", "4"], "does not split evenly over 4 replica(s)"),
        (["--model", "lenet", "--dataset", "shakespeare"], "needs a classification dataset"),
        (["--model", "resnet"], "unknown model 'resnet'"),
        (["--strategy", "single", "--devices", "2"], "pass --devices 1"),
        (["--model", "lenet", "--dataset", "synthetic"], "needs image-shaped inputs"),
        # options of another strategy, the examples, and one at its default
        (["--strategy", "dp", "--balance", "2,2"], "--balance is a pipeline option; pass"),
        (["--strategy", "dp", "--staleness", "2"], "--staleness is a ps option; pass"),
        (["--strategy", "dp", "--stages", "2"], "--stages is a pipeline option; pass"),
    ],
)
def test_bad_runs_are_refused_with_one_sentence(tmp_path, capsys, args, message):
    # --data-dir must exist (it is refused otherwise), so it is passed only where it does
    data_dir = ["--data-dir", str(SHARED_DATA)] if SHARED_DATA.exists() else []
    code, _, err = run_cli(capsys, *data_dir, "--run-dir", str(tmp_path / "r"), *args)
    assert code == 2
    assert message in err
    assert err.count("\n") == 1, err


def test_single_strategy_on_one_device(tmp_path, capsys):
    code, out, err = run_cli(
        capsys,
        "--model",
        "lenet",
        "--dataset",
        "synthetic_images",
        "--strategy",
        "single",
        "--devices",
        "1",
        "--steps",
        "3",
        "--global-batch",
        "8",
        "--run-dir",
        str(tmp_path / "s"),
        "--eval-every",
        "0",
    )
    assert code == 0, err
    assert "final eval loss" not in out and "worker 0:" in out
    state = load_model_state(tmp_path / "s" / "final")
    model = build_model("lenet")
    model.load_state_dict(state)
    assert torch.isfinite(state["0.weight"]).all()
