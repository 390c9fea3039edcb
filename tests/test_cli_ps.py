"""``paratrain train --strategy ps`` end to end: summary, metrics, checkpoint, a lost worker."""

from __future__ import annotations

from pathlib import Path

import pytest

from paratrain.checkpoints.format import load_model_state, read_manifest
from paratrain.models import build_model
from paratrain.parallel.ps import ParameterServerStrategy, shared_memory
from paratrain.parallel.ps.shared_memory import resolve_transport
from paratrain.reports.metrics_file import read_metrics
from tests.test_cli_train import SHARED_DATA, run_cli

MLP = ["--model", "mlp", "--dataset", "synthetic", "--hidden", "32", "--depth", "1"]


def run_summary(run_dir: Path) -> dict:
    """The closing summary record of a run's metrics file."""
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "summary"][0]


def load_final_mlp(run_dir: Path) -> None:
    """The final checkpoint loads into the ``MLP`` model the run trained."""
    state = load_model_state(run_dir / "final")
    build_model("mlp", in_features=784, hidden=32, depth=1, classes=10).load_state_dict(state)


@pytest.mark.slow
@pytest.mark.skipif(not SHARED_DATA.exists(), reason="../shared/data (tinyshakespeare) is absent")
def test_gpt_with_a_staleness_bound_on_four_workers(tmp_path, capsys):
    run_dir = tmp_path / "gpt"
    code, out, err = run_cli(
        capsys,
        *("--strategy", "ps", "--servers", "1", "--staleness", "2", "--devices", "4"),
        *("--data-dir", str(SHARED_DATA), "--n-layer", "1", "--n-embd", "32"),
        *("--block-size", "32", "--steps", "12", "--global-batch", "16"),
        *("--eval-every", "6", "--log-every", "3", "--sample-chars", "20"),
        *("--straggler", "3:2", "--run-dir", str(run_dir)),
    )
    assert code == 0, err
    assert "strategy ps, 4 worker(s), 12 steps, global batch 16" in out
    transport = resolve_transport("auto").replace("_", " ")
    said = f"servers           1 ({transport}), staleness bound 2, lr / (staleness + 1)"
    assert said in out
    assert "), lookahead pulls" in out
    assert "pushes/s          worker 0:" in out and "worker 3:" in out
    assert "push staleness" in out and "sample:" in out
    summary = run_summary(run_dir)
    assert sum(summary["ps"]["pushes"].values()) == 4 * 12
    assert sum(summary["ps"]["staleness_histogram"].values()) == 4 * 12
    assert read_manifest(run_dir / "final")["layout"]["strategy"] == "ps"


@pytest.mark.slow
def test_backup_worker_run_with_two_servers_evaluates_and_checkpoints(tmp_path, capsys):
    run_dir = tmp_path / "backup"
    code, out, err = run_cli(
        capsys,
        *("--strategy", "ps", "--staleness", "0", "--backup-workers", "1"),
        *("--servers", "2", "--devices", "3", "--straggler", "1:3", "--transport", "gloo"),
        *MLP,
        *("--steps", "10", "--global-batch", "24", "--eval-every", "5"),
        *("--checkpoint-every", "5", "--run-dir", str(run_dir)),
    )
    assert code == 0, err
    assert "staleness bound 0 (synchronous) with 1 backup worker(s)" in out
    assert "final eval loss" in out
    assert Path(run_dir / "checkpoints" / "step-00000005").exists()
    summary = run_summary(run_dir)
    assert summary["ps"]["backup_workers"] == 1
    assert summary["ps"]["transport"] == "gloo"
    assert sum(summary["ps"]["pushes"].values()) == 3 * 10
    assert summary["ps"]["samples_applied"] == 24 * 10, "late pushes are applied, not lost"
    load_final_mlp(run_dir)


@pytest.mark.slow
def test_asynchronous_run_survives_a_lost_worker(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PARATRAIN_FAULT", "kill:1:4")
    run_dir = tmp_path / "mlp"
    code, out, err = run_cli(
        capsys,
        *("--strategy", "ps", "--staleness", "none", "--servers", "2", "--devices", "3"),
        *MLP,
        *("--steps", "10", "--global-batch", "24", "--eval-every", "5"),
        *("--checkpoint-every", "5", "--run-dir", str(run_dir)),
    )
    assert code == 0, err
    assert "staleness bound none (asynchronous)" in out
    assert "lost worker       1: worker process 1 was killed by signal SIGKILL" in out
    assert "final eval loss" in out
    load_final_mlp(run_dir)
    assert Path(run_dir / "checkpoints" / "step-00000005").exists()
    summary = run_summary(run_dir)
    assert summary["ps"]["pushes"]["1"] == 3 and summary["ps"]["pushes"]["0"] == 10
    assert list(summary["ps"]["lost_workers"]) == ["1"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--strategy", "ps", "--devices", "2", "--straggler", "2:3"], "names worker 2"),
        (["--strategy", "dp", "--devices", "2", "--straggler", "1:3"], "is a ps option"),
        (["--strategy", "ps", "--staleness", "-1"], "staleness must be at least 0"),
        (["--strategy", "ps", "--straggler", "1"], "straggler must be RANK:SLOWDOWN"),
        (["--strategy", "ps", "--staleness-lr", "sqrt"], "staleness_lr must be inverse or"),
        (["--strategy", "ps", "--devices", "3", "--global-batch", "32"], "3 replica(s)"),
        (["--strategy", "ps", "--staleness", "none", "--backup-workers", "1"], "staleness=0"),
        (["--strategy", "dp", "--backup-workers", "1"], "--backup-workers is a ps option"),
        (["--strategy", "ps", "--devices", "2", "--backup-workers", "2"], "less than the number"),
        (["--strategy", "ps", "--backup-workers", "-1"], "backup_workers must be at least 0"),
        (["--strategy", "dp", "--transport", "gloo"], "--transport is a ps option"),
        (["--strategy", "dp", "--no-lookahead"], "--no-lookahead is a ps option"),
        (["--strategy", "ps", "--transport", "tcp"], "transport must be one of auto, shared_me"),
    ],
)
def test_bad_ps_settings_are_refused_before_any_worker_starts(tmp_path, capsys, args, message):
    code, _, err = run_cli(capsys, *MLP, "--run-dir", str(tmp_path / "r"), *args)
    assert code == 2
    assert message in err


def test_shared_memory_on_a_host_without_it_is_refused_before_any_worker_starts(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(shared_memory, "SHARED_DIR", tmp_path / "no-shm")
    args = ("--strategy", "ps", "--transport", "shared_memory")
    code, _, err = run_cli(capsys, *MLP, "--run-dir", str(tmp_path / "r"), *args)
    assert code == 2
    assert "needs a writable" in err and "pass transport='gloo'" in err


def test_the_summary_names_the_backup_workers_and_the_late_pushes_weight():
    ps = {
        "servers": 1,
        "staleness": 0,
        "backup_workers": 1,
        "staleness_lr": "inverse",
        "transport": "shared_memory",
        "mean_lr_factor": 0.8,
        "pushes_per_s": {0: 3.0, 1: 1.0},
        "staleness_histogram": {0: 9, 3: 2},
    }
    lines = ParameterServerStrategy.summary_lines(ps)
    said = "staleness bound 0 (synchronous) with 1 backup worker(s): late pushes fold in"
    assert said in lines[0]
    assert "servers           1 (shared memory)" in lines[0]
    assert "lr / (staleness + 1) (mean factor 0.80)" in lines[0]
    assert "0: 9, 3: 2" in lines[2]
    assert "lookahead" not in lines[0], "synchronous rounds never look ahead"


def test_the_summary_says_when_pulls_look_ahead():
    ps = {
        "servers": 1,
        "staleness": None,
        "staleness_lr": "inverse",
        "lookahead": True,
        "mean_lr_factor": 0.4,
        "pushes_per_s": {0: 3.0},
        "staleness_histogram": {2: 5},
    }
    line = ParameterServerStrategy.summary_lines(ps)[0]
    assert line.endswith("lr / (staleness + 1) (mean factor 0.40), lookahead pulls"), line
