"""Values that cannot train are refused in the parent, in one sentence, before any folder
is made (issue 24, items 6 and 11): model sizes and optimizer settings used to reach the
workers and end there as a 17-29 line traceback after ~8 s with an empty run folder; a
mistyped name gets the name it was probably meant to be."""

from __future__ import annotations

from pathlib import Path

import pytest

from paratrain.cli import main


@pytest.fixture(autouse=True)
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs create ``runs/`` in the cwd and downloads a cache: both point into tmp_path."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("PARATRAIN_DATA", raising=False)


GPT = ["--model", "gpt", "--dataset", "synthetic_tokens"]
MLP = ["--model", "mlp", "--dataset", "synthetic"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            [*GPT, "--n-embd", "66", "--n-head", "4"],
            "n_embd (66) must be divisible by n_head (4) so that every head has the same width.",
        ),
        ([*GPT, "--n-layer", "0"], "n_layer must be at least 1, not 0."),
        ([*GPT, "--n-head", "0"], "n_head must be at least 1, not 0."),
        ([*MLP, "--hidden", "0"], "hidden must be at least 1, not 0."),
        ([*MLP, "--weight-decay", "-1"], "weight_decay must be at least 0, not -1.0."),
        (
            [*MLP, "--momentum", "0.9"],
            "momentum is an SGD setting that adamw has no use for; pass --optimizer sgd or "
            "leave --momentum out.",
        ),
        (
            [*MLP, "--warmup-steps", "1000"],
            "--warmup-steps 1000 is longer than the run's 1 steps, so the lr would never "
            "reach --lr; lower --warmup-steps or train longer.",
        ),
        (
            ["--model", "gtp"],
            "unknown model 'gtp'; did you mean 'gpt'? choose one of mlp, lenet, gpt.",
        ),
        (
            [*MLP, "--strategy", "zer03"],
            "unknown strategy 'zer03'; did you mean 'zero3'? choose one of ",
        ),
        (
            ["--model", "mlp", "--dataset", "fashon_mnist"],
            "unknown dataset 'fashon_mnist'; did you mean 'fashion_mnist'? choose one of ",
        ),
        (["--model", "mlp", "--steps", "ten"], "steps must be an integer, not 'ten'."),
    ],
)
def test_refused_in_one_sentence_before_any_folder(tmp_path, capsys, args, message):
    code = main(["train", "--no-progress", "--steps", "1", "--devices", "1", *args])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"paratrain: error: {message}"), err
    assert err.count("\n") == 1, err  # one line, no traceback
    assert not (tmp_path / "runs").exists()  # nothing made on disk for a refused run
