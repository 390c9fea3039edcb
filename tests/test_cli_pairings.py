"""Every model x dataset pairing ``paratrain train`` accepts runs end to end, summary included.

A pairing that trains and then fails in its closing summary (gpt on synthetic_tokens once
crashed decoding its sample: that dataset has no text) is found only by running it, so
each accepted pairing runs two steps on one worker at the smallest sizes; the property
is the pairing, not the training. The real datasets are small generated copies in a
``--data-dir``, so no test needs the network.
"""

from __future__ import annotations

import math
import re
from itertools import product
from pathlib import Path

import pytest
import torch

from paratrain.cli import main
from paratrain.config import ConfigError, build_config
from paratrain.data import DATASETS
from paratrain.data.idx import write_idx
from paratrain.models import MODEL_NAMES
from paratrain.run.build import load_data
from paratrain.run.preflight import check_pairing

ACCEPTED = [
    ("mlp", "fashion_mnist"),
    ("mlp", "synthetic"),
    ("mlp", "synthetic_images"),
    ("lenet", "fashion_mnist"),
    ("lenet", "synthetic_images"),
    ("gpt", "shakespeare"),
    ("gpt", "synthetic_tokens"),
]
REFUSED = [pair for pair in product(MODEL_NAMES, DATASETS) if pair not in ACCEPTED]

TINY = [
    "--devices", "1", "--steps", "2", "--global-batch", "4", "--eval-every", "2",
    "--eval-batches", "1", "--log-every", "1", "--hidden", "8", "--depth", "1",
    "--n-layer", "1", "--n-head", "1", "--n-embd", "8", "--block-size", "8",
    "--sample-chars", "8", "--no-progress",
]  # fmt: skip


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Shakespeare and Fashion-MNIST stand-ins in the layout ``--data-dir`` reads."""
    root = tmp_path_factory.mktemp("data")
    (root / "tinyshakespeare").mkdir()
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n\n" * 20
    (root / "tinyshakespeare" / "input.txt").write_text(text)
    folder = root / "fashion_mnist"
    folder.mkdir()
    generator = torch.Generator().manual_seed(0)
    for prefix, n in (("train", 16), ("t10k", 8)):
        images = torch.randint(0, 256, (n, 28, 28), generator=generator, dtype=torch.uint8)
        write_idx(folder / f"{prefix}-images-idx3-ubyte.gz", images)
        labels = torch.arange(n, dtype=torch.uint8) % 10
        write_idx(folder / f"{prefix}-labels-idx1-ubyte.gz", labels)
    return root


@pytest.fixture(autouse=True)
def isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("PARATRAIN_DATA", raising=False)


def test_the_accepted_pairings_are_the_listed_ones(data_dir: Path) -> None:
    """The list the end-to-end runs below cover is the trainer's own: a model or dataset
    added later fails here until its pairings are run too."""
    accepted = []
    for model, dataset in product(MODEL_NAMES, DATASETS):
        config = build_config(
            overrides={
                "model": model,
                "dataset": dataset,
                "data_dir": str(data_dir),
                "global_batch": 4,  # as in TINY: the stand-ins are smaller than 32 samples
                "block_size": 8,
            }
        )
        try:
            check_pairing(config, load_data(config))
        except ConfigError:
            continue
        accepted.append((model, dataset))
    assert sorted(accepted) == sorted(ACCEPTED)


@pytest.mark.parametrize(("model", "dataset"), ACCEPTED)
def test_an_accepted_pairing_trains_and_prints_its_summary(
    model: str, dataset: str, data_dir: Path, tmp_path: Path, capsys
) -> None:
    run_dir = tmp_path / "run"
    code = main(
        ["train", "--model", model, "--dataset", dataset, "--data-dir", str(data_dir), *TINY,
         "--run-dir", str(run_dir)]
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.startswith(f"paratrain train: {model} on {dataset}, strategy dp, 1 worker(s)")
    losses = re.findall(r"final (?:train|eval) loss\s+(\S+)", out)
    assert len(losses) == 2 and all(math.isfinite(float(loss)) for loss in losses), out
    assert f"checkpoint        {run_dir / 'final'}" in out
    if model == "gpt":  # the sample: 8 generated tokens after a 1-token prompt
        sample = out.split("  sample:\n", 1)[1]
        assert sample.strip(), out
        if dataset == "synthetic_tokens":  # no text to decode to: the 9 token ids
            assert len(sample.split()) == 9 and all(t.isdigit() for t in sample.split())


@pytest.mark.parametrize(("model", "dataset"), REFUSED)
def test_a_refused_pairing_gets_one_line_and_no_run_folder(
    model: str, dataset: str, data_dir: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    monkeypatch.chdir(tmp_path)
    code = main(
        ["train", "--model", model, "--dataset", dataset, "--data-dir", str(data_dir), *TINY]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("paratrain: error: model ") and err.count("\n") == 1, err
    assert not (tmp_path / "runs").exists()
