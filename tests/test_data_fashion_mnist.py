"""IDX parsing and Fashion-MNIST loading from small generated files served via file://."""

from __future__ import annotations

import gzip
import hashlib
import struct
from pathlib import Path

import pytest
import torch

from paratrain.data import ChecksumError, load_fashion_mnist, read_idx
from paratrain.data.fashion_mnist import (
    FASHION_MNIST_MD5,
    FASHION_MNIST_MEAN,
    FASHION_MNIST_STD,
)
from paratrain.data.idx import write_idx

N_TRAIN, N_TEST = 20, 12


@pytest.fixture(autouse=True)
def isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path / "default-cache"))
    monkeypatch.delenv("PARATRAIN_DATA", raising=False)


def idx_bytes(code: int, dims: tuple[int, ...], payload: bytes) -> bytes:
    """Build an IDX file by hand (independently of write_idx)."""
    return bytes([0, 0, code, len(dims)]) + b"".join(struct.pack(">I", d) for d in dims) + payload


def generated_split(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 28, 28), generator=g, dtype=torch.uint8)
    labels = torch.randint(0, 10, (n,), generator=g, dtype=torch.uint8)
    return images, labels


@pytest.fixture
def server(tmp_path: Path) -> tuple[Path, dict[str, str], dict[str, torch.Tensor]]:
    """A folder holding the four gz files, their md5s, and the raw tensors."""
    folder = tmp_path / "server"
    folder.mkdir()
    train_x, train_y = generated_split(N_TRAIN, seed=1)
    test_x, test_y = generated_split(N_TEST, seed=2)
    tensors = {
        "train-images-idx3-ubyte.gz": train_x,
        "train-labels-idx1-ubyte.gz": train_y,
        "t10k-images-idx3-ubyte.gz": test_x,
        "t10k-labels-idx1-ubyte.gz": test_y,
    }
    md5s = {}
    for name, tensor in tensors.items():
        code = 0x08
        raw = idx_bytes(code, tuple(tensor.shape), bytes(tensor.reshape(-1).tolist()))
        data = gzip.compress(raw, mtime=0)
        (folder / name).write_bytes(data)
        md5s[name] = hashlib.md5(data).hexdigest()
    return folder, md5s, tensors


def normalized(images: torch.Tensor) -> torch.Tensor:
    return ((images.float() / 255.0 - FASHION_MNIST_MEAN) / FASHION_MNIST_STD).unsqueeze(1)


# --- IDX ---------------------------------------------------------------------------------


def test_read_idx_uint8_plain_and_gzip(tmp_path: Path) -> None:
    values = bytes(range(24))
    plain = tmp_path / "a.idx"
    plain.write_bytes(idx_bytes(0x08, (2, 3, 4), values))
    compressed = tmp_path / "a.idx.gz"
    compressed.write_bytes(gzip.compress(plain.read_bytes()))
    expected = torch.arange(24, dtype=torch.uint8).reshape(2, 3, 4)
    for path in (plain, compressed):
        tensor = read_idx(path)
        assert tensor.dtype == torch.uint8
        assert torch.equal(tensor, expected)


def test_read_idx_big_endian_multibyte_types(tmp_path: Path) -> None:
    ints = [1, -2, 300000, -(2**31)]
    path = tmp_path / "i.idx"
    path.write_bytes(idx_bytes(0x0C, (4,), struct.pack(">4i", *ints)))
    assert read_idx(path).tolist() == ints
    floats = [0.5, -1.25, 3.0]
    path.write_bytes(idx_bytes(0x0E, (3,), struct.pack(">3d", *floats)))
    tensor = read_idx(path)
    assert tensor.dtype == torch.float64 and tensor.tolist() == floats


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32, torch.float32])
def test_write_idx_round_trip(tmp_path: Path, dtype: torch.dtype) -> None:
    tensor = (torch.arange(-30, 30).reshape(3, 4, 5) * 3).to(dtype)
    path = write_idx(tmp_path / "t.idx.gz", tensor)
    assert path.read_bytes()[:2] == b"\x1f\x8b"
    assert torch.equal(read_idx(path), tensor)


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"\x01\x00\x08\x01" + struct.pack(">I", 1) + b"x", "magic number"),
        (b"\x00\x00\x07\x01" + struct.pack(">I", 1) + b"x", "type code 0x07"),
        (b"\x00\x00\x08\x03" + struct.pack(">I", 1), "ends inside its header"),
        (idx_bytes(0x08, (2, 28, 28), bytes(100)), "promises shape (2, 28, 28)"),
        (idx_bytes(0x08, (3,), bytes(4)), "promises shape (3,)"),
        (b"\x00\x00", "magic number"),
        (gzip.compress(idx_bytes(0x08, (4,), bytes(4)), mtime=0)[:-12], "gzip stream is damaged"),
    ],
)
def test_read_idx_rejects_malformed_files(tmp_path: Path, content: bytes, reason: str) -> None:
    path = tmp_path / "bad-idx3-ubyte.gz"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="is not a valid IDX file") as info:
        read_idx(path)
    assert reason in str(info.value)
    assert str(path) in str(info.value)


# --- Fashion-MNIST -------------------------------------------------------------------------


def test_published_checksums_are_torchvisions() -> None:
    assert FASHION_MNIST_MD5 == {
        "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
        "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
        "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
        "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
    }


def test_load_fashion_mnist_end_to_end_through_fetch(server, tmp_path: Path) -> None:
    folder, md5s, tensors = server
    cache = tmp_path / "cache"
    train, test = load_fashion_mnist(
        cache_dir=cache, base_url=folder.as_uri() + "/", checksums=md5s
    )
    images, labels = train.tensors
    assert images.shape == (N_TRAIN, 1, 28, 28) and images.dtype == torch.float32
    assert labels.shape == (N_TRAIN,) and labels.dtype == torch.int64
    # The loader and ``normalized`` both take x / 255, subtract the mean and divide by the
    # std in float32 (perhaps in place, in another op order): a few roundings of 2^-24 on
    # values of size ~3, far inside allclose's defaults (rtol 1e-5, atol 1e-8).
    assert torch.allclose(images, normalized(tensors["train-images-idx3-ubyte.gz"]))
    assert torch.equal(labels, tensors["train-labels-idx1-ubyte.gz"].long())
    test_images, test_labels = test.tensors
    assert test_images.shape == (N_TEST, 1, 28, 28)
    assert torch.allclose(test_images, normalized(tensors["t10k-images-idx3-ubyte.gz"]))
    assert torch.equal(test_labels, tensors["t10k-labels-idx1-ubyte.gz"].long())
    # pixel 0 maps to -mean/std, pixel 255 to (1-mean)/std
    assert images.min() >= -FASHION_MNIST_MEAN / FASHION_MNIST_STD - 1e-6
    assert images.max() <= (1 - FASHION_MNIST_MEAN) / FASHION_MNIST_STD + 1e-6
    assert sorted(p.name for p in (cache / "fashion_mnist").iterdir()) == sorted(md5s)

    # second time: from the cache, the server may be gone
    for path in folder.iterdir():
        path.unlink()
    train2, _ = load_fashion_mnist(cache_dir=cache, download=False, checksums=md5s)
    assert torch.equal(train2.tensors[0], images)


def test_base_url_without_trailing_slash(server, tmp_path: Path) -> None:
    folder, md5s, _ = server
    train, _ = load_fashion_mnist(
        cache_dir=tmp_path / "c", base_url=folder.as_uri(), checksums=md5s
    )
    assert len(train) == N_TRAIN


def test_wrong_checksum_is_refused(server, tmp_path: Path) -> None:
    folder, md5s, _ = server
    bad = dict(md5s, **{"t10k-labels-idx1-ubyte.gz": "0" * 32})
    cache = tmp_path / "cache"
    with pytest.raises(ChecksumError, match="t10k-labels-idx1-ubyte.gz"):
        load_fashion_mnist(cache_dir=cache, base_url=folder.as_uri() + "/", checksums=bad)
    assert not (cache / "fashion_mnist" / "t10k-labels-idx1-ubyte.gz").exists()


def test_real_checksums_refuse_generated_files(server, tmp_path: Path) -> None:
    folder, _, _ = server
    with pytest.raises(ChecksumError, match="8d4fb7e6c68d591d4c3dfef9ec88bf0d"):
        load_fashion_mnist(cache_dir=tmp_path / "cache", base_url=folder.as_uri() + "/")


def test_corrupted_cache_with_download_false(server, tmp_path: Path) -> None:
    folder, md5s, _ = server
    cache = tmp_path / "cache"
    load_fashion_mnist(cache_dir=cache, base_url=folder.as_uri() + "/", checksums=md5s)
    (cache / "fashion_mnist" / "train-images-idx3-ubyte.gz").write_bytes(b"garbage")
    with pytest.raises(ChecksumError, match="delete the file"):
        load_fashion_mnist(cache_dir=cache, download=False, checksums=md5s)


def test_missing_files_without_download(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="download=False") as info:
        load_fashion_mnist(data_dir=tmp_path / "data", cache_dir=tmp_path / "c", download=False)
    assert "train-images-idx3-ubyte.gz" in str(info.value)
    assert str(tmp_path / "data") in str(info.value)


@pytest.mark.parametrize("layout", ["fashion_mnist", "FashionMNIST/raw", "."])
def test_data_dir_copies_are_used_as_is(server, tmp_path: Path, layout: str) -> None:
    folder, _, tensors = server
    data_dir = tmp_path / "data"
    target = data_dir / layout
    target.mkdir(parents=True)
    for path in folder.iterdir():
        (target / path.name).write_bytes(path.read_bytes())
    # real checksums would refuse these files; a user's own copy is not checksummed
    train, test = load_fashion_mnist(data_dir=data_dir, cache_dir=tmp_path / "c", download=False)
    assert torch.equal(train.tensors[1], tensors["train-labels-idx1-ubyte.gz"].long())
    assert len(test) == N_TEST


def test_paratrain_data_env_is_searched(server, tmp_path: Path, monkeypatch) -> None:
    folder, _, _ = server
    shared = tmp_path / "shared"
    (shared / "fashion_mnist").mkdir(parents=True)
    for path in folder.iterdir():
        (shared / "fashion_mnist" / path.name).write_bytes(path.read_bytes())
    monkeypatch.setenv("PARATRAIN_DATA", str(shared))
    train, _ = load_fashion_mnist(cache_dir=tmp_path / "c", download=False)
    assert len(train) == N_TRAIN


def test_images_and_labels_of_different_length_are_refused(server, tmp_path: Path) -> None:
    folder, _, _ = server
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    for path in folder.iterdir():
        (data_dir / path.name).write_bytes(path.read_bytes())
    labels = torch.zeros(N_TRAIN - 1, dtype=torch.uint8)
    write_idx(data_dir / "train-labels-idx1-ubyte.gz", labels)
    with pytest.raises(ValueError, match="same Fashion-MNIST split"):
        load_fashion_mnist(data_dir=data_dir, download=False)


def test_incomplete_checksum_table_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="t10k-images-idx3-ubyte.gz"):
        load_fashion_mnist(cache_dir=tmp_path, checksums={"train-images-idx3-ubyte.gz": "0"})
