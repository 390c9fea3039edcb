"""Tiny Shakespeare (Karpathy's char-rnn corpus) as a character-level :class:`TextCorpus`.

Where the text comes from, first match wins:

1. ``data_dir/tinyshakespeare/input.txt`` or ``data_dir/input.txt`` -- a copy the user
   pointed at, used as is;
2. ``$PARATRAIN_DATA/tinyshakespeare/input.txt`` -- a shared data folder (a cluster's
   read-only dataset mount, say), used as is;
3. ``<cache_dir>/tinyshakespeare/input.txt`` -- an earlier download, checksum-verified;
4. a download into that cache path (only with ``download=True``).

Where none of these gives the file, :class:`~paratrain.data.missing.DatasetUnavailable`
names the file, each of these places and the command that puts it there.

A user's own copy is never rejected for its checksum (it may be deliberately edited or
re-encoded), but a difference from the reference file is logged, because numbers from a
different text are not comparable with published ones.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from .download import default_cache_dir, fetch, file_digest, verify_checksum
from .missing import DatasetUnavailable, failure, unavailable
from .text import TextCorpus

__all__ = ["SHAKESPEARE_SHA256", "SHAKESPEARE_URL", "load_shakespeare"]

SHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
)
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
SHAKESPEARE_BYTES = 1_115_394

_FOLDER = "tinyshakespeare"
_FILE = "input.txt"

logger = logging.getLogger(__name__)


def load_shakespeare(
    *,
    data_dir: str | Path | None = None,
    cache_dir: str | Path | None = None,
    block_size: int = 64,
    val_fraction: float = 0.1,
    download: bool = True,
    url: str = SHAKESPEARE_URL,
) -> TextCorpus:
    """Load Tiny Shakespeare, downloading it into the cache on first use.

    ``block_size`` is the window length of each ``(inputs, targets)`` sample and
    ``val_fraction`` the share of the text (its end) kept for validation. ``url`` exists
    for mirrors and tests; whatever it serves must still match the reference checksum.
    """
    path = _locate(data_dir=data_dir, cache_dir=cache_dir, download=download, url=url)
    text = path.read_text(encoding="utf-8")
    return TextCorpus.from_text(text, block_size=block_size, val_fraction=val_fraction, source=path)


def _locate(
    *, data_dir: str | Path | None, cache_dir: str | Path | None, download: bool, url: str
) -> Path:
    user_copies: list[Path] = []
    if data_dir is not None:
        root = Path(data_dir).expanduser()
        user_copies += [root / _FOLDER / _FILE, root / _FILE]
    shared = os.environ.get("PARATRAIN_DATA")
    if shared:
        user_copies.append(Path(shared).expanduser() / _FOLDER / _FILE)
    for candidate in user_copies:
        if candidate.is_file():
            _note_if_different(candidate)
            return candidate

    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    cached = cache / _FOLDER / _FILE
    if download:
        try:
            return fetch(url, cached, sha256=SHAKESPEARE_SHA256)
        except OSError as error:
            why = f"could not be downloaded from {url} ({failure(error)})"
            raise _unavailable(data_dir, cache, why) from error
    if cached.is_file():
        verify_checksum(cached, sha256=SHAKESPEARE_SHA256)
        return cached
    why = f"download=False was passed (pass download=True to fetch it from {url})"
    raise _unavailable(data_dir, cache, why)


def _unavailable(data_dir: str | Path | None, cache: Path, why: str) -> DatasetUnavailable:
    return unavailable(
        "Tiny Shakespeare",
        [_FILE],
        folder=_FOLDER,
        layouts=[_FOLDER, ""],
        data_dir=data_dir,
        cache=cache,
        why=why,
    )


def _note_if_different(path: Path) -> None:
    """Log, without refusing, a local copy that is not the reference file."""
    if path.stat().st_size == SHAKESPEARE_BYTES and file_digest(path, "sha256") == (
        SHAKESPEARE_SHA256
    ):
        return
    logger.warning(
        "Using %s as is although it differs from the reference Tiny Shakespeare "
        "(sha256 %s); results will not be comparable with runs on the reference text.",
        path,
        SHAKESPEARE_SHA256,
    )
