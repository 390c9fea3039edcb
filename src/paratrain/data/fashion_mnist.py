"""Fashion-MNIST (Zalando, 2017): 60,000 train and 10,000 test 28x28 grayscale images.

Each of the four published ``.gz`` files is looked for, first match wins, in
``data_dir/fashion_mnist/``, ``data_dir/FashionMNIST/raw/`` (torchvision's layout, so an
existing torchvision copy is reused), ``data_dir/`` and
``$PARATRAIN_DATA/fashion_mnist/`` -- used as is -- and then in
``<cache_dir>/fashion_mnist/``, which :func:`~paratrain.data.download.fetch` fills from
``base_url`` and verifies against the published MD5 checksums (the ones torchvision
uses). ``base_url`` and ``checksums`` are parameters so that a mirror, or a test serving
generated files from ``file://``, goes through the very same code.

Images come back as ``float32`` of shape ``(N, 1, 28, 28)``, scaled to [0, 1] and then
normalized with the training set's mean and standard deviation, because every reference
model here expects zero-centred inputs; labels are ``int64``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from .download import default_cache_dir, fetch, verify_checksum
from .idx import read_idx
from .missing import DatasetUnavailable, failure, unavailable

__all__ = [
    "DEFAULT_URL",
    "FASHION_MNIST_MD5",
    "FASHION_MNIST_MEAN",
    "FASHION_MNIST_STD",
    "load_fashion_mnist",
]

DEFAULT_URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"

FASHION_MNIST_MD5: dict[str, str] = {
    "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
    "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
    "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
    "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
}
FASHION_MNIST_MEAN = 0.2860
FASHION_MNIST_STD = 0.3530

_FOLDER = "fashion_mnist"
# where in data_dir the files are read, first match wins: ours, torchvision's, the folder
_LAYOUTS = (_FOLDER, "FashionMNIST/raw", "")
_SPLITS = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}


def load_fashion_mnist(
    *,
    data_dir: str | Path | None = None,
    cache_dir: str | Path | None = None,
    download: bool = True,
    base_url: str = DEFAULT_URL,
    checksums: Mapping[str, str] | None = None,
) -> tuple[TensorDataset, TensorDataset]:
    """Return ``(train, test)`` datasets of ``(image, label)``, downloading on first use.

    ``checksums`` maps each of the four file names to its MD5 (default: the published
    ones); ``base_url`` is where those names are fetched from.
    """
    checksums = dict(FASHION_MNIST_MD5 if checksums is None else checksums)
    missing = sorted(set(FASHION_MNIST_MD5) - set(checksums))
    if missing:
        raise ValueError(
            f"checksums has no MD5 for {', '.join(missing)}; give one for each of "
            f"{', '.join(FASHION_MNIST_MD5)}."
        )
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    datasets = []
    for images_name, labels_name in _SPLITS.values():
        paths = [
            _locate(
                name,
                data_dir=data_dir,
                cache=cache / _FOLDER,
                download=download,
                base_url=base_url,
                md5=checksums[name],
            )
            for name in (images_name, labels_name)
        ]
        datasets.append(_to_dataset(*paths))
    return datasets[0], datasets[1]


def _locate(
    name: str,
    *,
    data_dir: str | Path | None,
    cache: Path,
    download: bool,
    base_url: str,
    md5: str,
) -> Path:
    user_copies: list[Path] = []
    if data_dir is not None:
        root = Path(data_dir).expanduser()
        user_copies += [root / layout / name for layout in _LAYOUTS]
    shared = os.environ.get("PARATRAIN_DATA")
    if shared:
        user_copies.append(Path(shared).expanduser() / _FOLDER / name)
    for candidate in user_copies:
        if candidate.is_file():
            return candidate

    cached = cache / name
    url = base_url if base_url.endswith("/") else base_url + "/"
    if download:
        try:
            return fetch(url + name, cached, md5=md5)
        except OSError as error:
            why = f"could not be downloaded from {url} ({failure(error)})"
            raise _unavailable(data_dir, cache.parent, why) from error
    if cached.is_file():
        verify_checksum(cached, md5=md5)
        return cached
    why = f"download=False was passed (pass download=True to fetch {name} from {url})"
    raise _unavailable(data_dir, cache.parent, why)


def _unavailable(data_dir: str | Path | None, cache: Path, why: str) -> DatasetUnavailable:
    return unavailable(
        "Fashion-MNIST",
        list(FASHION_MNIST_MD5),
        folder=_FOLDER,
        layouts=_LAYOUTS,
        data_dir=data_dir,
        cache=cache,
        why=why,
    )


def _to_dataset(images_path: Path, labels_path: Path) -> TensorDataset:
    """Pair an images file with its labels file, checking they describe the same set."""
    images = read_idx(images_path)
    labels = read_idx(labels_path)
    if images.dim() != 3 or labels.dim() != 1 or images.shape[0] != labels.shape[0]:
        raise ValueError(
            f"{images_path.name} has shape {tuple(images.shape)} and {labels_path.name} "
            f"{tuple(labels.shape)}, but Fashion-MNIST needs (N, rows, cols) images and N "
            "labels; check that both files are from the same Fashion-MNIST split."
        )
    pixels = images.to(torch.float32).div_(255.0).unsqueeze(1)
    pixels = pixels.sub_(FASHION_MNIST_MEAN).div_(FASHION_MNIST_STD)
    return TensorDataset(pixels, labels.to(torch.int64))
