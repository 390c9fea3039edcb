"""Datasets and batch loaders for paratrain.

Real datasets (Tiny Shakespeare, Fashion-MNIST) are found locally or downloaded once,
checksum-verified, into a cache; synthetic ones are generated from a seed. Loaders yield
the same global batches on every rank (or each rank's share of them), which is what
``engine.train_step`` expects. :func:`build_dataset` picks a dataset by name for the CLI.
"""

from .download import ChecksumError, default_cache_dir, fetch
from .fashion_mnist import load_fashion_mnist
from .idx import read_idx
from .loader import GlobalBatchLoader, ShardedBatchLoader, batches, whole_split
from .missing import DatasetUnavailable
from .registry import DATASETS, DatasetBundle, build_dataset, dataset_key
from .shakespeare import load_shakespeare
from .synthetic import synthetic_classification, synthetic_images, synthetic_tokens
from .text import TextCorpus

__all__ = [
    "DATASETS",
    "ChecksumError",
    "DatasetBundle",
    "DatasetUnavailable",
    "GlobalBatchLoader",
    "ShardedBatchLoader",
    "TextCorpus",
    "batches",
    "build_dataset",
    "dataset_key",
    "default_cache_dir",
    "fetch",
    "load_fashion_mnist",
    "load_shakespeare",
    "read_idx",
    "synthetic_classification",
    "synthetic_images",
    "synthetic_tokens",
    "whole_split",
]
