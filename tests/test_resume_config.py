"""A resume takes its settings from the checkpoint, refuses flags that contradict it, and
fails in one sentence, before any worker starts and without leaving a folder, on a
checkpoint it cannot use."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from paratrain.checkpoints.format import Checkpoint, save_model_state
from paratrain.cli import main
from paratrain.config import ConfigError, TrainConfig, as_dict
from paratrain.models import build_model
from paratrain.reports.metrics_file import read_metrics
from paratrain.reports.run_data import load_run
from paratrain.reports.text import summarize_run
from paratrain.run.resume import run_dir_of, settle_failed_run
from paratrain.run.resume_config import resume_config
from paratrain.runtime.launch import WorkerError
from tests.test_parity_dp import relative_error

MLP = {"model": "mlp", "dataset": "synthetic", "hidden": 16, "depth": 1}


def saved_run(tmp_path: Path, config: dict | None = None, **settings) -> Path:
    """A checkpoint as the trainer writes it (an mlp on synthetic data), without training:
    the weights of the model ``settings`` describe, and that config in its metadata."""
    settings = {**MLP, **settings}
    torch.manual_seed(0)
    model = build_model("mlp", in_features=784, hidden=settings["hidden"], depth=1, classes=10)
    full = as_dict(TrainConfig(**settings)) if config is None else config
    metadata = {"config": full} if full else {}
    return save_model_state(tmp_path / "run" / "final", model.state_dict(), metadata=metadata)


def test_the_saved_settings_are_taken_and_the_changeable_ones_overridden(tmp_path):
    saved = saved_run(
        tmp_path, lr=0.01, global_batch=8, seed=3, steps=4, strategy="pipeline", stages=2
    )
    config = resume_config({}, {"resume": str(tmp_path / "run"), "steps": "6", "devices": "2"})
    assert (config.model, config.hidden, config.lr, config.global_batch, config.seed) == (
        "mlp",
        16,
        0.01,
        8,
        3,
    )
    assert (config.steps, config.devices, config.strategy, config.stages) == (6, 2, "pipeline", 2)
    assert config.resume == str(tmp_path / "run") and config.run_dir is None
    # another strategy drops the saved strategy's options (stages would be refused)
    config = resume_config({}, {"resume": str(saved), "strategy": "zero1"})
    assert config.strategy == "zero1" and config.stages == TrainConfig().stages


def test_a_given_length_replaces_the_saved_one_whether_steps_or_epochs(tmp_path):
    saved_run(tmp_path, epochs=1)  # a run by epochs, resumed for a number of steps
    config = resume_config({}, {"resume": str(tmp_path / "run"), "steps": "20"})
    assert (config.steps, config.epochs) == (20, None)
    config = resume_config({}, {"resume": str(tmp_path / "run"), "epochs": "3"})
    assert (config.steps, config.epochs) == (None, 3)
    config = resume_config({}, {"resume": str(tmp_path / "run")})
    assert (config.steps, config.epochs) == (None, 1)


@pytest.mark.parametrize(
    ("flag", "value", "said"),
    [
        ("hidden", "32", "--hidden 32 contradicts checkpoint"),
        ("model", "gpt", "--model gpt contradicts checkpoint"),
        ("lr", "0.1", "--lr 0.1 contradicts checkpoint"),
        ("global_batch", "16", "--global-batch 16 contradicts checkpoint"),
    ],
)
def test_a_flag_contradicting_the_checkpoint_is_refused(tmp_path, flag, value, said):
    saved = saved_run(tmp_path)
    with pytest.raises(ConfigError, match=said) as caught:
        resume_config({}, {"resume": str(saved), flag: value})
    assert "\n" not in str(caught.value) and "drop --" in str(caught.value)
    assert resume_config({}, {"resume": str(saved), flag: getattr(TrainConfig(**MLP), flag)})


def test_a_config_file_value_is_named_as_such(tmp_path):
    saved = saved_run(tmp_path)
    with pytest.raises(ConfigError, match="hidden = 8 in run.toml .* remove hidden from run"):
        resume_config({"hidden": 8}, {"resume": str(saved)}, config_file="run.toml")


def test_an_imported_checkpoint_fixes_only_the_model(tmp_path):
    saved = saved_run(tmp_path, config=dict(MLP))  # what ckpt import saves
    config = resume_config({}, {"resume": str(saved), "lr": "0.1", "seed": "5"})
    assert (config.hidden, config.lr, config.seed) == (16, 0.1, 5)
    with pytest.raises(ConfigError, match="--hidden 32"):
        resume_config({}, {"resume": str(saved), "hidden": "32"})


def test_a_checkpoint_without_saved_settings_takes_the_flags(tmp_path):
    saved = saved_run(tmp_path, config={})
    config = resume_config({}, {"resume": str(saved), **MLP, "hidden": "32"})
    assert config.hidden == 32  # the parent's shape check refuses it (next test)


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_model_that_does_not_fit_is_refused_before_any_worker(tmp_path, capsys):
    saved = saved_run(tmp_path, config={})
    flags = [f"--{k}={v}" for k, v in MLP.items()]
    new = tmp_path / "new"
    code, _, err = run_cli(
        capsys, "train", "--resume", str(saved), *flags, "--hidden=32", "--run-dir", str(new)
    )
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "holds '1.weight' of shape (16, 784), but the model's is (32, 784)" in err
    assert not new.exists()


def test_a_damaged_checkpoint_is_refused_in_the_sentence_inspect_gives(tmp_path, capsys):
    saved = saved_run(tmp_path, steps=4)
    shard = saved / "model-0.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    _, _, inspect_err = run_cli(capsys, "ckpt", "inspect", str(tmp_path / "run"))
    new = tmp_path / "new"
    code, out, err = run_cli(
        capsys, "train", "--resume", str(tmp_path / "run"), "--steps", "6", "--run-dir", str(new)
    )
    assert code == 2 and out == "" and err == inspect_err
    assert err.count("\n") == 1 and "is damaged or was changed after saving" in err
    assert not new.exists() and sorted(p.name for p in (tmp_path / "run").iterdir()) == ["final"]


def test_a_failed_run_leaves_no_empty_folder_and_marks_a_logged_one(tmp_path):
    error = WorkerError(1, "Traceback (most recent call last):\n  ...\nRuntimeError: boom\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text(json.dumps({"kind": "config"}) + "\n")
    settle_failed_run(empty, error, created=True)
    assert not empty.exists()
    logged = tmp_path / "logged"
    logged.mkdir()
    (logged / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 1}) + "\n")
    settle_failed_run(logged, error, created=True)
    assert (
        read_metrics(logged / "metrics.jsonl")[-1]["error"] == "worker 1 failed: RuntimeError: boom"
    )
    existing = tmp_path / "existing"  # a resumed run's own folder is never removed
    existing.mkdir()
    settle_failed_run(existing, error, created=False)
    assert read_metrics(existing / "metrics.jsonl")[0]["kind"] == "failed"
    # and `paratrain report` says so
    (existing / "metrics.jsonl").write_text(
        json.dumps({"kind": "config", "config": {"model": "mlp"}})
        + "\n"
        + (existing / "metrics.jsonl").read_text()
    )
    assert "failed              worker 1 failed: RuntimeError: boom" in summarize_run(
        load_run(existing)
    )


@pytest.mark.slow
def test_a_worker_failing_before_any_checkpoint_leaves_no_run_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PARATRAIN_FAULT", "kill:1:1")
    run_dir = tmp_path / "dead"
    flags = [f"--{k}={v}" for k, v in MLP.items()]
    code, _, _ = run_cli(
        capsys, "train", *flags, "--steps", "3", "--devices", "2", "--no-progress",
        "--eval-every", "0", "--timeout", "30", "--run-dir", str(run_dir),
    )  # fmt: skip
    assert code == 1 and not run_dir.exists()


GPT = ["--model", "gpt", "--n-embd", "32", "--n-layer", "1", "--n-head", "2", "--block-size", "16"]
GPT_RUN = [*GPT, "--lr", "0.01", "--global-batch", "8", "--seed", "3", "--devices", "2"]
QUIET = ["--no-progress", "--eval-every", "0", "--sample-chars", "0"]
SHAKESPEARE = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.mark.slow
def test_resume_with_no_model_flags_ends_where_an_uninterrupted_run_does(
    tmp_path, capsys, monkeypatch
):
    """The resumed run must train the saved model with the saved lr, batch and seed: any
    of them taken from the defaults instead (lr 0.003, batch 32, seed 0, width 128) fails
    to load or moves the weights by a relative ~1e-2 over two steps. Same layout, same ops
    in the same order: the only difference allowed is float reordering, far below 1e-6
    (the bound test_resume.py uses for the same comparison)."""
    if SHAKESPEARE.exists():
        monkeypatch.setenv("PARATRAIN_DATA", str(SHAKESPEARE))
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert main(["train", *GPT_RUN, *QUIET, "--steps", "6", "--run-dir", str(whole)]) == 0
    flags = ["--steps", "4", "--checkpoint-every", "2", "--run-dir", str(part)]
    assert main(["train", *GPT_RUN, *QUIET, *flags]) == 0
    capsys.readouterr()
    code, out, err = run_cli(capsys, "train", "--resume", str(part), "--steps", "6")
    assert code == 0
    said = f"from {part / 'final'} at step 4 (saved under dp on 2 worker(s); now dp on 2 worker(s))"
    assert f"paratrain: resuming {said}" in err and f"resumed {said}" in out
    resumed = Checkpoint(part / "final")
    assert resumed.step == 6 and resumed.metadata["config"]["n_embd"] == 32
    assert relative_error(resumed.model_state(), Checkpoint(whole / "final").model_state()) <= 1e-6


def test_only_a_runs_checkpoint_names_a_run_folder_to_continue_in():
    assert run_dir_of(Path("r/final")) == Path("r")
    assert run_dir_of(Path("r/checkpoints/step-00000004")) == Path("r")
    assert run_dir_of(Path("ckpt/imported")) is None  # a new run folder, not ckpt/
