"""The ``paratrain train`` line ``paratrain plan`` prints trains exactly the run planned.

It once dropped model options (``--n-embd 1024``), ``--memory-per-device`` and
``--data-dir``: pasted, it trained another run. Each test parses the printed line with the
command line's own parser and builds its configuration as ``paratrain train`` does.
"""

from __future__ import annotations

import shlex
from dataclasses import fields, replace

import pytest

from paratrain.cli import build_parser
from paratrain.cli.train_line import train_line
from paratrain.config import TrainConfig, build_config


def _trained_by(line: str) -> TrainConfig:
    """The configuration ``paratrain train`` builds from ``line``, as ``cli._train`` does."""
    words = shlex.split(line)
    assert words[:2] == ["paratrain", "train"], line
    args = build_parser().parse_args(words[1:])
    assert args.command == "train" and args.config is None
    return build_config({}, {item.name: getattr(args, item.name) for item in fields(TrainConfig)})


def test_every_field_off_its_default_survives_the_round_trip(tmp_path):
    config = replace(
        TrainConfig(),
        model="gpt",
        dataset="synthetic",
        strategy="pipeline",
        devices=4,
        n_embd=1024,
        n_layer=6,
        block_size=128,
        tie_embeddings=not TrainConfig().tie_embeddings,
        memory_per_device="16GiB",
        data_dir=str(tmp_path / "a folder with spaces"),
        lr=1.2345678901234567e-4,
        weight_decay=0.1,
        steps=500,
        precision="bf16",
        progress=False,
        stages=4,
        micro_batches=8,
        recompute=True,
    )
    assert _trained_by(train_line(config)) == config


@pytest.mark.slow
def test_the_plan_commands_line_is_the_planned_run(tmp_path, monkeypatch, capsys):
    from paratrain.cli import main
    from paratrain.run import prepare

    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path / "cache"))
    planned = []
    plan_run = prepare.plan_run

    def recorded(config, **keywords):
        planned.append(plan_run(config, **keywords))
        return planned[-1]

    monkeypatch.setattr(prepare, "plan_run", recorded)
    data = tmp_path / "data"
    data.mkdir()
    flags = ["--model", "mlp", "--dataset", "synthetic", "--hidden", "48", "--depth", "2"]
    flags += ["--global-batch", "16", "--memory-per-device", "64MiB", "--data-dir", str(data)]
    flags += ["--lr", "0.01", "--seed", "3", "--steps", "7"]  # no --devices: resolved
    assert main(["plan", *flags]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("to train with it: "), line
    ((config, chosen, _bundle),) = planned
    expected = replace(config, devices=chosen.devices)
    assert _trained_by(line.removeprefix("to train with it: ")) == expected
