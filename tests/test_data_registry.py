"""build_dataset(): every name gives a bundle the CLI can pair with a model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import paratrain.data as data
from paratrain.data import DATASETS, DatasetBundle, build_dataset
from paratrain.data.idx import write_idx


@pytest.fixture(autouse=True)
def isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path / "default-cache"))
    monkeypatch.delenv("PARATRAIN_DATA", raising=False)


def test_public_names() -> None:
    for name in data.__all__:
        assert hasattr(data, name), name
    assert set(DATASETS) == {
        "shakespeare",
        "fashion_mnist",
        "synthetic",
        "synthetic_images",
        "synthetic_tokens",
    }


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="Unknown dataset 'cifar10'") as info:
        build_dataset("cifar10")
    for name in DATASETS:
        assert name in str(info.value)


@pytest.mark.parametrize(
    ("name", "shape"), [("synthetic", (784,)), ("synthetic_images", (1, 28, 28))]
)
def test_synthetic_classification_bundles(name: str, shape: tuple[int, ...]) -> None:
    bundle = build_dataset(name, synthetic_size=256, seed=3)
    assert isinstance(bundle, DatasetBundle)
    assert bundle.kind == "classification" and bundle.num_classes == 10
    assert bundle.vocab_size is None and bundle.decode is None
    assert bundle.input_shape == shape
    assert len(bundle.train) == 256 and len(bundle.val) == 32
    x, y = bundle.train[0]
    assert tuple(x.shape) == shape and y.dtype == torch.int64
    train_rows = {tuple(r.flatten().tolist()) for r in bundle.train.tensors[0]}
    assert not any(tuple(r.flatten().tolist()) in train_rows for r in bundle.val.tensors[0])
    again = build_dataset(name, synthetic_size=256, seed=3)
    assert torch.equal(again.train.tensors[0], bundle.train.tensors[0])
    other = build_dataset(name, synthetic_size=256, seed=4)
    assert not torch.equal(other.train.tensors[0], bundle.train.tensors[0])


def test_synthetic_tokens_bundle() -> None:
    bundle = build_dataset("synthetic_tokens", block_size=16, synthetic_size=64)
    assert bundle.kind == "tokens" and bundle.vocab_size == 65
    assert bundle.input_shape == (16,)
    inputs, targets = bundle.train[0]
    assert inputs.shape == (16,) and torch.equal(inputs[1:], targets[:-1])
    assert len(bundle.val) == 8


def test_shakespeare_bundle_from_data_dir(tmp_path: Path) -> None:
    text = "Now is the winter of our discontent\nMade glorious summer by this sun of York;\n" * 4
    (tmp_path / "tinyshakespeare").mkdir()
    (tmp_path / "tinyshakespeare" / "input.txt").write_text(text, encoding="utf-8")
    bundle = build_dataset("shakespeare", data_dir=tmp_path, block_size=8)
    assert bundle.kind == "tokens" and bundle.vocab_size == len(set(text))
    assert bundle.input_shape == (8,) and bundle.num_classes is None
    assert bundle.decode(bundle.train[0][0]) == text[:8]


def test_fashion_mnist_bundle_from_data_dir(tmp_path: Path) -> None:
    folder = tmp_path / "fashion_mnist"
    folder.mkdir()
    for prefix, n in (("train", 6), ("t10k", 4)):
        write_idx(
            folder / f"{prefix}-images-idx3-ubyte.gz", torch.zeros(n, 28, 28, dtype=torch.uint8)
        )
        write_idx(folder / f"{prefix}-labels-idx1-ubyte.gz", torch.arange(n, dtype=torch.uint8))
    bundle = build_dataset("Fashion-MNIST", data_dir=tmp_path)
    assert bundle.kind == "classification" and bundle.num_classes == 10
    assert bundle.input_shape == (1, 28, 28)
    assert len(bundle.train) == 6 and len(bundle.val) == 4
    assert bundle.val.tensors[1].tolist() == [0, 1, 2, 3]


def test_bad_synthetic_size() -> None:
    with pytest.raises(ValueError, match="synthetic_size must be at least 1"):
        build_dataset("synthetic", synthetic_size=0)
