"""Data that is not there: a missing ``--data-dir``, a dataset that cannot be downloaded.

Both are refused in one sentence before any run folder exists; the download failure's
sentence names every file the dataset needs, every place searched and the command that
places the files, and the failed download leaves no empty cache folder behind. The
network is replaced by a ``urlopen`` that fails as an offline machine's does.
"""

from __future__ import annotations

import io
import re
import subprocess
import urllib.error
from pathlib import Path

import pytest

from paratrain.cli import main
from paratrain.config import build_config
from paratrain.data import download, fetch
from paratrain.data.fashion_mnist import FASHION_MNIST_MD5
from paratrain.run.build import load_data

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\n" * 20


@pytest.fixture(autouse=True)
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No network, an empty cache, no $PARATRAIN_DATA, and the test's folder as the cwd
    (where a run would create ``runs/``)."""

    def refuse(*args, **kwargs):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(download.urllib.request, "urlopen", refuse)
    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("PARATRAIN_DATA", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path / "cache"


def train(capsys, *args: str) -> tuple[int, str]:
    code = main(["train", "--no-progress", "--devices", "1", "--steps", "1", *args])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("kind", ["missing", "a file"])
def test_a_data_dir_that_is_not_a_folder_is_refused_naming_it(tmp_path, capsys, kind) -> None:
    data_dir = tmp_path / "no-such-data"
    if kind == "a file":
        data_dir.write_text("")
    code, err = train(
        capsys, "--model", "mlp", "--dataset", "synthetic", "--data-dir", str(data_dir)
    )
    assert code == 2
    state = "does not exist" if kind == "missing" else "is not a folder"
    assert f"--data-dir {data_dir} {state}" in err and err.count("\n") == 1, err
    assert not (tmp_path / "runs").exists()


def test_fashion_mnist_offline_names_files_places_and_command(tmp_path, offline, capsys) -> None:
    code, err = train(capsys, "--model", "mlp", "--dataset", "fashion_mnist")
    assert code == 2 and err.count("\n") == 1, err
    for name in FASHION_MNIST_MD5:
        assert name in err
    assert "Temporary failure in name resolution" in err
    assert "DIR/fashion_mnist/ or DIR/FashionMNIST/raw/ or DIR/ (no --data-dir given)" in err
    assert "$PARATRAIN_DATA/fashion_mnist/ (PARATRAIN_DATA is not set)" in err
    assert f"the cache as {offline / 'fashion_mnist'}/" in err
    assert f"`mkdir -p {offline / 'fashion_mnist'} && cp " in err
    assert not offline.exists(), "the failed download left an empty cache folder"
    assert not (tmp_path / "runs").exists()


def test_shakespeare_offline_with_a_data_dir_and_paratrain_data(
    tmp_path, offline, monkeypatch, capsys
) -> None:
    data_dir, shared = tmp_path / "data", tmp_path / "shared"
    data_dir.mkdir()
    monkeypatch.setenv("PARATRAIN_DATA", str(shared))
    code, err = train(capsys, "--dataset", "shakespeare", "--data-dir", str(data_dir))
    assert code == 2 and err.count("\n") == 1, err
    assert f"{data_dir}/tinyshakespeare/input.txt or {data_dir}/input.txt" in err
    assert f"$PARATRAIN_DATA as {shared}/tinyshakespeare/input.txt" in err
    assert f"the cache as {offline}/tinyshakespeare/input.txt" in err
    assert not offline.exists()


def test_the_printed_command_places_the_file_where_the_next_run_finds_it(tmp_path, capsys) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    config = build_config(
        overrides={"dataset": "shakespeare", "data_dir": str(data_dir), "block_size": 8}
    )
    code, err = train(capsys, "--dataset", "shakespeare", "--data-dir", str(data_dir))
    assert code == 2
    command = re.search(r"`([^`]+)`", err).group(1)
    downloads = tmp_path / "downloads"  # where the user copied the file to
    downloads.mkdir()
    (downloads / "input.txt").write_text(TEXT)
    subprocess.run(["bash", "-c", command], cwd=downloads, check=True)
    bundle = load_data(config)
    assert bundle.decode(bundle.train[0][0].tolist()) == TEXT[:8]


def test_paratrain_data_is_searched_before_the_network(tmp_path, offline, monkeypatch) -> None:
    shared = tmp_path / "shared"
    (shared / "tinyshakespeare").mkdir(parents=True)
    (shared / "tinyshakespeare" / "input.txt").write_text(TEXT)
    monkeypatch.setenv("PARATRAIN_DATA", str(shared))
    bundle = load_data(build_config(overrides={"dataset": "shakespeare", "block_size": 8}))
    assert bundle.decode(bundle.train[0][0].tolist()) == TEXT[:8]
    assert not offline.exists()


class _Page(io.BytesIO):
    headers = None  # no Content-Length


def test_a_download_that_fails_its_checksum_is_refused_in_one_line(
    tmp_path, offline, monkeypatch, capsys
) -> None:
    """A proxy serving another file: the run stops with fetch's sentence, not a traceback."""
    monkeypatch.setattr(download.urllib.request, "urlopen", lambda *a, **k: _Page(b"<html>"))
    code, err = train(capsys, "--dataset", "shakespeare")
    assert code == 2 and err.count("\n") == 1, err
    assert "was discarded; check the URL" in err
    assert not (tmp_path / "runs").exists()


def test_a_failed_fetch_removes_only_the_folders_it_created(tmp_path) -> None:
    kept = tmp_path / "kept"
    (kept / "other").mkdir(parents=True)
    with pytest.raises(OSError, match="Could not download"):
        fetch("https://example.invalid/x.bin", kept / "a" / "b" / "x.bin", progress=False)
    assert sorted(p.name for p in kept.iterdir()) == ["other"]
