"""Download a file once, verify it, and keep it in a cache.

Every dataset loader in paratrain goes through :func:`fetch`, so the rules live in one
place:

- A file that is already at ``dest`` with the expected checksum is returned without
  touching the network, which makes a second run (or a second rank) free and lets
  people work offline once the cache is warm.
- A download goes to a temporary file in the destination folder and is moved into place
  with :func:`os.replace` only after its checksum matched. Several ranks fetching the
  same file at once, or a run killed half-way, therefore never leave a truncated file at
  ``dest`` that a later run would trust.
- ``urllib`` handles ``http://``, ``https://`` and ``file://`` alike, so tests exercise
  this exact code with local files instead of a mocked network.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from tqdm.auto import tqdm

__all__ = ["ChecksumError", "default_cache_dir", "fetch", "file_digest", "verify_checksum"]

_CHUNK_BYTES = 1 << 20
_TIMEOUT_S = 60.0


class ChecksumError(ValueError):
    """A file's digest differs from the one it was published with.

    A ``ValueError`` because the *content* is wrong, not the I/O: retrying the same
    read would give the same answer.
    """


def default_cache_dir() -> Path:
    """Where downloads are kept: ``$PARATRAIN_CACHE``, else ``$XDG_CACHE_HOME/paratrain``,
    else ``~/.cache/paratrain``.

    Read at call time (not import time) so a test or a job script can redirect it with
    an environment variable.
    """
    explicit = os.environ.get("PARATRAIN_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "paratrain"
    return Path.home() / ".cache" / "paratrain"


def file_digest(path: str | Path, algorithm: str) -> str:
    """Hex digest of a file, read in chunks so a large file never sits in memory."""
    digest = _new_hash(algorithm)
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(_CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify_checksum(path: str | Path, *, sha256: str | None = None, md5: str | None = None) -> None:
    """Raise :class:`ChecksumError` unless ``path`` has every digest that is given.

    Used for files found on disk (a cache copy with ``download=False``), where the fix
    is to delete the file so that it is fetched again.
    """
    path = Path(path)
    for algorithm, expected in _expected(sha256=sha256, md5=md5):
        actual = file_digest(path, algorithm)
        if actual != expected:
            raise ChecksumError(
                f"{path} has {algorithm} {actual} but {expected} was expected; delete the "
                "file so that it is downloaded again, or check that it is the right file."
            )


def fetch(
    url: str,
    dest: str | Path,
    *,
    sha256: str | None = None,
    md5: str | None = None,
    progress: bool = True,
) -> Path:
    """Return ``dest`` holding the content of ``url``, downloading only when needed.

    If ``dest`` exists and matches the given checksum(s) it is returned as is (with no
    checksum given, existence is enough). Otherwise ``url`` is downloaded next to
    ``dest``, verified, and atomically moved into place; a file at ``dest`` that failed
    its checksum is replaced only by a download that passes.

    Raises :class:`ChecksumError` when the download does not match (``dest`` is left as
    it was), and :class:`OSError` when the URL cannot be read.
    """
    dest = Path(dest)
    expected = _expected(sha256=sha256, md5=md5)
    if dest.is_file() and all(file_digest(dest, algo) == want for algo, want in expected):
        return dest

    created = [folder for folder in (dest.parent, *dest.parent.parents) if not folder.exists()]
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        _download_to(url, dest, expected, progress)
    except BaseException:
        _remove_empty(created)  # a failed first download leaves no empty cache folder
        raise
    return dest


def _download_to(url: str, dest: Path, expected: list[tuple[str, str]], progress: bool) -> None:
    """Download into a temporary file beside ``dest``; move it there only if it verifies."""
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            actual = _download_into(url, out, [algo for algo, _ in expected], progress, dest)
        for algorithm, want in expected:
            if actual[algorithm] != want:
                raise ChecksumError(
                    f"The download of {url} for {dest} has {algorithm} {actual[algorithm]} "
                    f"but {want} was expected, so it was discarded; check the URL (a proxy "
                    "or mirror may serve a different file) or the expected checksum."
                )
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def _remove_empty(folders: list[Path]) -> None:
    """Remove the folders a failed download created, deepest first, where still empty (a
    concurrent fetch may have put a file in one meanwhile: that one stays)."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def _download_into(
    url: str, out, algorithms: list[str], progress: bool, dest: Path
) -> dict[str, str]:
    """Stream ``url`` into the open file ``out``, hashing as it goes (one pass)."""
    digests = {algorithm: _new_hash(algorithm) for algorithm in algorithms}
    try:
        response = urllib.request.urlopen(url, timeout=_TIMEOUT_S)
    except (urllib.error.URLError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise OSError(
            f"Could not download {url} ({reason}); check the URL and the network, or put "
            f"the file at {dest} yourself."
        ) from exc
    with response:
        size = _content_length(response)
        with tqdm(
            total=size,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=dest.name,
            disable=not progress or size is None,
            leave=False,
        ) as bar:
            for chunk in iter(lambda: response.read(_CHUNK_BYTES), b""):
                out.write(chunk)
                for digest in digests.values():
                    digest.update(chunk)
                bar.update(len(chunk))
    return {algorithm: digest.hexdigest() for algorithm, digest in digests.items()}


def _content_length(response) -> int | None:
    value = response.headers.get("Content-Length") if response.headers else None
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _expected(*, sha256: str | None, md5: str | None) -> list[tuple[str, str]]:
    pairs = [("sha256", sha256), ("md5", md5)]
    return [(algorithm, want.lower()) for algorithm, want in pairs if want is not None]


def _new_hash(algorithm: str):
    if algorithm == "md5":
        # md5 only identifies published files here; it is not used for security.
        return hashlib.md5(usedforsecurity=False)
    return hashlib.new(algorithm)
