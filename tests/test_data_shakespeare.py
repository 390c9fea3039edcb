"""Tiny Shakespeare: lookup order, windows, encode/decode, on generated text and the real corpus."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from paratrain.data import ChecksumError, TextCorpus, load_shakespeare
from paratrain.data.shakespeare import SHAKESPEARE_SHA256
from paratrain.data.text import next_token_windows

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
REAL_CORPUS = SHARED_DATA / "tinyshakespeare" / "input.txt"
needs_real_corpus = pytest.mark.skipif(
    not REAL_CORPUS.is_file(),
    reason=f"the real Tiny Shakespeare is not at {REAL_CORPUS} (shared data folder absent)",
)

TEXT = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind.\n" * 3


@pytest.fixture(autouse=True)
def isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path / "default-cache"))
    monkeypatch.delenv("PARATRAIN_DATA", raising=False)


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "data" / "tinyshakespeare"
    folder.mkdir(parents=True)
    (folder / "input.txt").write_text(TEXT, encoding="utf-8")
    return tmp_path / "data"


def test_windows_are_consecutive_and_shifted(data_dir: Path) -> None:
    corpus = load_shakespeare(data_dir=data_dir, block_size=8, val_fraction=0.25, download=False)
    assert corpus.vocab == sorted(set(TEXT))
    assert corpus.vocab_size == len(set(TEXT))
    split = int(len(TEXT) * 0.75)
    train_text, val_text = TEXT[:split], TEXT[split:]
    assert len(corpus.train) == (len(train_text) - 1) // 8
    assert len(corpus.val) == (len(val_text) - 1) // 8
    for k in range(len(corpus.train)):
        inputs, targets = corpus.train[k]
        assert inputs.dtype == torch.long and inputs.shape == (8,)
        assert corpus.decode(inputs) == train_text[8 * k : 8 * k + 8]
        assert corpus.decode(targets) == train_text[8 * k + 1 : 8 * k + 9]
    inputs, targets = corpus.val[len(corpus.val) - 1]
    k = len(corpus.val) - 1
    assert corpus.decode(inputs) == val_text[8 * k : 8 * k + 8]
    assert corpus.decode(targets) == val_text[8 * k + 1 : 8 * k + 9]
    assert corpus.source == data_dir / "tinyshakespeare" / "input.txt"


def test_encode_decode_round_trip(data_dir: Path) -> None:
    corpus = load_shakespeare(data_dir=data_dir, block_size=4, download=False)
    ids = corpus.encode("be the mind")
    assert ids.dtype == torch.long
    assert ids.tolist() == [corpus.vocab.index(c) for c in "be the mind"]
    assert corpus.decode(ids) == "be the mind"
    assert corpus.decode(ids.tolist()) == "be the mind"
    with pytest.raises(ValueError, match="'Z' is not in"):
        corpus.encode("Zebra")
    with pytest.raises(ValueError, match=f"Token id {corpus.vocab_size} is outside"):
        corpus.decode([0, corpus.vocab_size])


def test_input_txt_directly_in_data_dir(tmp_path: Path) -> None:
    (tmp_path / "input.txt").write_text(TEXT, encoding="utf-8")
    corpus = load_shakespeare(data_dir=tmp_path, block_size=4, download=False)
    assert corpus.decode(corpus.train[0][0]) == TEXT[:4]


def test_user_copy_is_used_but_noted(data_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="paratrain.data.shakespeare"):
        corpus = load_shakespeare(data_dir=data_dir, block_size=4, download=False)
    assert len(corpus.train) > 0
    assert "differs from the reference" in caplog.text
    assert SHAKESPEARE_SHA256 in caplog.text


def test_paratrain_data_env(data_dir: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PARATRAIN_DATA", str(data_dir))
    corpus = load_shakespeare(cache_dir=tmp_path / "none", block_size=4, download=False)
    assert corpus.source == data_dir / "tinyshakespeare" / "input.txt"


def test_not_found_without_download_says_where_and_how(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        load_shakespeare(data_dir=tmp_path / "d", cache_dir=tmp_path / "c", download=False)
    message = str(info.value)
    assert str(tmp_path / "d" / "tinyshakespeare" / "input.txt") in message
    assert str(tmp_path / "c" / "tinyshakespeare" / "input.txt") in message
    assert "download=True" in message


def test_download_refuses_a_file_that_is_not_the_corpus(data_dir: Path, tmp_path: Path) -> None:
    url = (data_dir / "tinyshakespeare" / "input.txt").as_uri()
    cache = tmp_path / "cache"
    with pytest.raises(ChecksumError, match=SHAKESPEARE_SHA256):
        load_shakespeare(cache_dir=cache, url=url)
    assert not (cache / "tinyshakespeare" / "input.txt").exists()


def test_text_too_short_is_refused() -> None:
    with pytest.raises(ValueError, match="too short for block_size 64"):
        TextCorpus.from_text("abc" * 10, block_size=64)
    with pytest.raises(ValueError, match="val_fraction"):
        TextCorpus.from_text(TEXT, val_fraction=1.0)


def test_val_fraction_zero_gives_empty_val() -> None:
    corpus = TextCorpus.from_text(TEXT, block_size=5, val_fraction=0.0)
    assert len(corpus.val) == 0 and len(corpus.train) == (len(TEXT) - 1) // 5


def test_next_token_windows_exact() -> None:
    windows = next_token_windows(torch.arange(11), 3)
    inputs, targets = windows.tensors
    assert inputs.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert targets.tolist() == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert len(next_token_windows(torch.arange(3), 3)) == 0


@needs_real_corpus
def test_real_corpus_from_shared_data(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="paratrain.data.shakespeare"):
        corpus = load_shakespeare(data_dir=SHARED_DATA, download=False)
    assert caplog.text == ""  # the reference file is not "noted"
    assert corpus.vocab_size == 65
    assert "".join(corpus.vocab) == (
        "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
    )
    n = 1_115_394
    split = int(n * 0.9)
    assert len(corpus.train) == (split - 1) // 64 == 15685
    assert len(corpus.val) == (n - split - 1) // 64 == 1742
    inputs, targets = corpus.train[0]
    assert corpus.decode(inputs).startswith("First Citizen:\nBefore we proceed")
    assert torch.equal(inputs[1:], targets[:-1])
    text = REAL_CORPUS.read_text(encoding="utf-8")
    assert corpus.decode(corpus.val[0][0]) == text[split : split + 64]


@needs_real_corpus
def test_real_corpus_download_path_into_cache(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    corpus = load_shakespeare(cache_dir=cache, block_size=128, url=REAL_CORPUS.as_uri())
    cached = cache / "tinyshakespeare" / "input.txt"
    assert cached.read_bytes() == REAL_CORPUS.read_bytes()
    assert corpus.source == cached and corpus.vocab_size == 65
    again = load_shakespeare(cache_dir=cache, block_size=128, download=False)
    assert torch.equal(again.train.tensors[0], corpus.train.tensors[0])
    cached.write_text("tampered", encoding="utf-8")
    with pytest.raises(ChecksumError, match="delete the file"):
        load_shakespeare(cache_dir=cache, download=False)
