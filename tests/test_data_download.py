"""fetch(): checksums, the cache, atomic replacement, and its error sentences.

Everything goes through real urllib with file:// URLs, so the code under test is the
code users run; no network is touched.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import pytest

import paratrain.data.download as download
from paratrain.data import ChecksumError, default_cache_dir, fetch
from paratrain.data.download import file_digest, verify_checksum

PAYLOAD = b"paratrain test payload\n" * 1000


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "server" / "payload.bin"
    path.parent.mkdir()
    path.write_bytes(PAYLOAD)
    return path


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".part"))


def test_fetch_downloads_and_verifies_sha256(source: Path, tmp_path: Path) -> None:
    dest = tmp_path / "cache" / "sub" / "payload.bin"
    result = fetch(source.as_uri(), dest, sha256=sha256(PAYLOAD), progress=False)
    assert result == dest
    assert dest.read_bytes() == PAYLOAD
    assert leftovers(dest.parent) == []


def test_fetch_verifies_md5_and_both_digests(source: Path, tmp_path: Path) -> None:
    dest = tmp_path / "a.bin"
    fetch(source.as_uri(), dest, md5=md5(PAYLOAD), progress=False)
    assert dest.read_bytes() == PAYLOAD
    dest2 = tmp_path / "b.bin"
    fetch(source.as_uri(), dest2, sha256=sha256(PAYLOAD), md5=md5(PAYLOAD).upper(), progress=False)
    assert dest2.read_bytes() == PAYLOAD


def test_cache_hit_does_not_read_the_url(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dest = tmp_path / "cache" / "payload.bin"
    fetch(source.as_uri(), dest, sha256=sha256(PAYLOAD), progress=False)
    source.unlink()  # the "server" is gone

    def no_network(*args, **kwargs):
        raise AssertionError("a cache hit must not open the URL")

    monkeypatch.setattr(download.urllib.request, "urlopen", no_network)
    assert fetch(source.as_uri(), dest, sha256=sha256(PAYLOAD), progress=False) == dest
    assert fetch(source.as_uri(), dest, md5=md5(PAYLOAD), progress=False) == dest
    assert dest.read_bytes() == PAYLOAD


def test_existing_file_without_checksum_is_trusted(tmp_path: Path) -> None:
    dest = tmp_path / "mine.txt"
    dest.write_bytes(b"user content")
    missing = (tmp_path / "nowhere.txt").as_uri()
    assert fetch(missing, dest, progress=False).read_bytes() == b"user content"


def test_stale_cache_file_is_replaced_by_a_verified_download(source: Path, tmp_path: Path) -> None:
    dest = tmp_path / "payload.bin"
    dest.write_bytes(b"stale, truncated")
    fetch(source.as_uri(), dest, sha256=sha256(PAYLOAD), progress=False)
    assert dest.read_bytes() == PAYLOAD
    assert leftovers(tmp_path) == []


def test_checksum_mismatch_raises_and_leaves_no_file(source: Path, tmp_path: Path) -> None:
    dest = tmp_path / "cache" / "payload.bin"
    wrong = "0" * 64
    with pytest.raises(ChecksumError) as info:
        fetch(source.as_uri(), dest, sha256=wrong, progress=False)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert source.as_uri() in message and str(dest) in message
    assert wrong in message and sha256(PAYLOAD) in message
    assert "check the URL" in message
    assert not dest.exists()
    assert not dest.parent.exists()  # the folder fetch created, empty again, is removed


def test_checksum_mismatch_keeps_the_previous_file(source: Path, tmp_path: Path) -> None:
    dest = tmp_path / "payload.bin"
    dest.write_bytes(b"previous content")
    with pytest.raises(ChecksumError):
        fetch(source.as_uri(), dest, md5="f" * 32, progress=False)
    assert dest.read_bytes() == b"previous content"


class _BrokenResponse(io.BytesIO):
    """A response that delivers one chunk and then loses the connection."""

    headers = {"Content-Length": str(len(PAYLOAD))}

    def __init__(self) -> None:
        super().__init__(PAYLOAD)
        self.calls = 0

    def read(self, size: int = -1) -> bytes:
        self.calls += 1
        if self.calls > 1:
            raise ConnectionResetError("connection lost mid-download")
        return super().read(100)


def test_interrupted_download_never_leaves_a_partial_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(download.urllib.request, "urlopen", lambda *a, **k: _BrokenResponse())
    dest = tmp_path / "payload.bin"
    with pytest.raises(ConnectionResetError):
        fetch("https://example.invalid/payload.bin", dest, sha256=sha256(PAYLOAD))
    assert not dest.exists()
    assert list(tmp_path.iterdir()) == []


def test_unreadable_url_raises_oserror_naming_it(tmp_path: Path) -> None:
    url = (tmp_path / "missing.bin").as_uri()
    with pytest.raises(OSError, match="Could not download") as info:
        fetch(url, tmp_path / "out.bin", progress=False)
    assert url in str(info.value)
    assert not (tmp_path / "out.bin").exists()
    assert leftovers(tmp_path) == []


def test_progress_bar_gets_the_size(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[dict] = []
    real_tqdm = download.tqdm

    def recording_tqdm(*args, **kwargs):
        seen.append(kwargs)
        return real_tqdm(*args, **{**kwargs, "disable": True})

    monkeypatch.setattr(download, "tqdm", recording_tqdm)
    fetch(source.as_uri(), tmp_path / "a.bin", progress=True)
    fetch(source.as_uri(), tmp_path / "b.bin", progress=False)
    assert seen[0]["total"] == len(PAYLOAD) and seen[0]["disable"] is False
    assert seen[1]["disable"] is True


def test_verify_checksum_names_the_file_and_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(PAYLOAD)
    verify_checksum(path, sha256=sha256(PAYLOAD), md5=md5(PAYLOAD))
    assert file_digest(path, "md5") == md5(PAYLOAD)
    with pytest.raises(ChecksumError, match="delete the file") as info:
        verify_checksum(path, md5="1" * 32)
    assert str(path) in str(info.value) and md5(PAYLOAD) in str(info.value)


def test_default_cache_dir_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("PARATRAIN_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "paratrain"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "paratrain"
    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path / "explicit"))
    assert default_cache_dir() == tmp_path / "explicit"
