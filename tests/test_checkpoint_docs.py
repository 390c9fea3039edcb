"""docs/checkpoints.md's table, every row run as printed: the commands are taken from the
page itself (the table after ``<!-- checkpoint-table -->``) and run in a folder holding
the sources the page names."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from paratrain.cli import main
from tests import dcp_workers, hf_workers
from tests.test_dcp import pytorch_folder

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("transformers", reason="the dev extra installs transformers")


def table_commands() -> list[str]:
    text = (ROOT / "docs" / "checkpoints.md").read_text()
    table = text.split("<!-- checkpoint-table -->\n", 1)[1].split("\n\n", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ")][1:]
    commands = [re.findall(r"`(paratrain [^`]*)`", row) for row in rows]
    assert all(len(found) == 1 for found in commands), "a row without exactly one command"
    return [found[0] for found in commands]


def sources(folder: Path) -> None:
    """The run, the DCP folder and the files the page's commands read."""
    engine = hf_workers.engine("single", "gpt2", "adam")
    inputs, targets = hf_workers.batches()[0]
    engine.train_step(inputs, targets)
    engine.save_checkpoint(folder / "runs" / "demo" / "final")
    pytorch_folder(folder, "named").rename(folder / "dcp-in")
    model = dcp_workers.mlp().state_dict()
    torch.save({f"module.{name}": tensor for name, tensor in model.items()}, folder / "ddp.pt")
    save_file(model, str(folder / "weights.safetensors"))


@pytest.mark.slow
def test_every_row_of_the_table_runs_as_printed(tmp_path, monkeypatch, capsys):
    sources(tmp_path)
    monkeypatch.chdir(tmp_path)
    commands = table_commands()
    assert len(commands) == 8
    for command in commands:
        words = shlex.split(command)
        assert words[0] == "paratrain"
        assert main(words[1:]) == 0, (command, capsys.readouterr().err)
    said = capsys.readouterr()
    for made in ("hf-model/config.json", "dcp-out/.metadata", "model.safetensors", "model.pt"):
        assert (tmp_path / made).exists(), made
    assert "optimizer state carried (exp_avg, exp_avg_sq, step, adam lr 0.01)" in said.out
    assert "resuming from imported at step 0" in said.err
