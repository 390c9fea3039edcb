"""Datasets by name, each with what the CLI needs to pair it with a model.

A :class:`DatasetBundle` carries, besides the train/validation datasets, the kind of task
("classification" or "tokens"), the vocabulary or class count and the input shape,
so ``paratrain train --dataset shakespeare --model gpt`` can size the model from the
data instead of asking the user to repeat numbers the dataset already knows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from torch.utils.data import Dataset, TensorDataset

from .fashion_mnist import load_fashion_mnist
from .shakespeare import load_shakespeare
from .synthetic import synthetic_classification, synthetic_images, synthetic_tokens

__all__ = ["DATASETS", "DatasetBundle", "build_dataset", "dataset_key"]

DATASETS = ("shakespeare", "fashion_mnist", "synthetic", "synthetic_images", "synthetic_tokens")

_SYNTHETIC_CLASSES = 10
_SYNTHETIC_VOCAB = 65  # the size of Tiny Shakespeare's vocabulary, so GPT configs carry over


@dataclass
class DatasetBundle:
    """Train and validation data plus the facts a model needs to be built for them.

    ``kind`` is ``"classification"`` (targets are class ids, ``num_classes`` set) or
    ``"tokens"`` (targets are next tokens, ``vocab_size`` set). ``input_shape`` is the
    shape of one sample's inputs, without the batch dimension. ``decode`` turns token
    ids back into text where the dataset has text.
    """

    train: Dataset
    val: Dataset
    kind: Literal["classification", "tokens"]
    vocab_size: int | None
    decode: Callable | None
    input_shape: tuple[int, ...]
    num_classes: int | None = None


def build_dataset(
    name: str,
    *,
    data_dir: str | Path | None = None,
    block_size: int = 64,
    seed: int = 0,
    synthetic_size: int = 4096,
) -> DatasetBundle:
    """Build the dataset called ``name`` (one of :data:`DATASETS`).

    ``data_dir`` is where real datasets are looked for before downloading;
    ``block_size`` is the token window of text datasets; ``seed`` and
    ``synthetic_size`` (training samples; validation gets an eighth as many more) apply
    to the synthetic ones.
    """
    key = dataset_key(name)
    if key == "shakespeare":
        corpus = load_shakespeare(data_dir=data_dir, block_size=block_size)
        return DatasetBundle(
            corpus.train, corpus.val, "tokens", corpus.vocab_size, corpus.decode, (block_size,)
        )
    if key == "fashion_mnist":
        train, test = load_fashion_mnist(data_dir=data_dir)
        shape = tuple(train.tensors[0].shape[1:])
        return DatasetBundle(train, test, "classification", None, None, shape, _SYNTHETIC_CLASSES)
    if key == "synthetic":
        data = synthetic_classification(
            _total(synthetic_size), classes=_SYNTHETIC_CLASSES, seed=seed
        )
        train, val = _split(data, synthetic_size)
        shape = tuple(data.tensors[0].shape[1:])
        return DatasetBundle(train, val, "classification", None, None, shape, _SYNTHETIC_CLASSES)
    if key == "synthetic_images":
        data = synthetic_images(_total(synthetic_size), classes=_SYNTHETIC_CLASSES, seed=seed)
        train, val = _split(data, synthetic_size)
        shape = tuple(data.tensors[0].shape[1:])
        return DatasetBundle(train, val, "classification", None, None, shape, _SYNTHETIC_CLASSES)
    if key == "synthetic_tokens":
        data = synthetic_tokens(
            _total(synthetic_size), block_size=block_size, vocab_size=_SYNTHETIC_VOCAB, seed=seed
        )
        train, val = _split(data, synthetic_size)
        return DatasetBundle(train, val, "tokens", _SYNTHETIC_VOCAB, None, (block_size,))
    raise AssertionError(f"dataset {key!r} is in DATASETS but has no builder")


def dataset_key(name: str) -> str:
    """The name of :data:`DATASETS` that ``name`` means (case and ``-``/``_`` forgiven).

    Raises ``ValueError`` naming the known datasets, so a run can refuse an unknown name
    before it creates anything.
    """
    key = name.strip().lower().replace("-", "_")
    if key not in DATASETS:
        raise ValueError(f"Unknown dataset {name!r}; choose one of {', '.join(DATASETS)}.")
    return key


def _total(train_size: int) -> int:
    if train_size < 1:
        raise ValueError(f"synthetic_size must be at least 1, got {train_size}.")
    return train_size + max(train_size // 8, 1)


def _split(data: TensorDataset, train_size: int) -> tuple[TensorDataset, TensorDataset]:
    """First ``train_size`` rows train, the rest validate; still ``TensorDataset``\\ s (not
    ``Subset``) so the loaders' fast path applies."""
    head = TensorDataset(*(t[:train_size] for t in data.tensors))
    tail = TensorDataset(*(t[train_size:] for t in data.tensors))
    return head, tail
