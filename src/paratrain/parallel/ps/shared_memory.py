"""Shared-memory buffers between a ps worker and its servers (the processes share a host).

Why: every step a worker pulls the whole model and pushes a gradient of the same size.
Over gloo's loopback TCP each of those transfers costs about 1.35 ms of CPU on each side
for the quick-start gpt (3.2 MB), on top of the copies into and out of the message, and a
ps run on a small machine is CPU-bound: the transfers were about a tenth of each push's
CPU. ``paratrain.launch`` starts every worker and server on one host (``ps`` is refused
anywhere else), so the tensors can instead lie in memory both sides map; only the small
headers still go over gloo, and they are what orders the two sides' accesses:

- push: the worker packs its gradient into its push region, then sends the header; the
  server reads the region before it replies, and the worker writes it again only after
  that reply (at its next push).
- pull: the worker sends the header; the server packs its parameters into the worker's
  pull region before it replies, and writes it again only at that worker's next pull.

Each worker creates its two regions per server as files under ``/dev/shm`` (a RAM file
system), asks each server to map them (``Op.ATTACH``), and deletes the files as soon as
the servers answered, success or not: the mappings stay valid, and nothing is left
behind in ``/dev/shm`` however the processes end later. Space is reserved when a file
is created (``posix_fallocate``), so a ``/dev/shm`` too small for the model (Docker's
default is 64 MB) is a clear error at setup rather than a SIGBUS on the first write.

The regions hold raw tensor bytes only (never a pickle); a server maps only a file in the
shared-memory folder whose name carries this module's prefix and whose size is exactly
the shard's.
"""

from __future__ import annotations

import errno
import mmap
import os
import uuid
from pathlib import Path

import torch

from paratrain.parallel.ps.protocol import ShardLayout

SHARED_DIR = Path("/dev/shm")
NAME_PREFIX = "paratrain-ps-"
_ALIGN = 64  # bytes: every flat tensor starts on a cache line
TRANSPORTS = ("auto", "shared_memory", "gloo")


def resolve_transport(transport: object) -> str:
    """``"shared_memory"`` or ``"gloo"``; ``"auto"`` is shared memory where the host has it.

    The choice is reported (the engine's ``layout()``, the run summary), so ``auto``
    picking gloo on a host without ``/dev/shm`` is visible, not silent.
    """
    if transport not in TRANSPORTS:
        raise ValueError(
            f"transport must be one of {', '.join(map(repr, TRANSPORTS))}, not {transport!r}."
        )
    if transport == "auto":
        return "shared_memory" if shared_memory_available() else "gloo"
    if transport == "shared_memory" and not shared_memory_available():
        raise ValueError(
            f"transport 'shared_memory' needs a writable {SHARED_DIR} (a RAM file system), "
            "which this host lacks; pass transport='gloo' (or 'auto')."
        )
    return transport


def shared_memory_available() -> bool:
    return SHARED_DIR.is_dir() and os.access(SHARED_DIR, os.W_OK | os.X_OK)


def region_bytes(layout: ShardLayout) -> int:
    """Bytes of one region holding ``layout``'s flat tensors, each cache-line aligned."""
    total = 0
    for size, dtype in zip(layout.sizes, layout.dtypes, strict=True):
        total = _aligned(total) + size * _itemsize(dtype)
    return max(_aligned(total), _ALIGN)


class SharedRegion:
    """One mapped region and the flat tensors (one per dtype of a layout) that view it."""

    def __init__(self, path: Path, mapping: mmap.mmap, layout: ShardLayout) -> None:
        self.path = path
        self._mapping = mapping  # kept: the tensors below view its memory
        raw = torch.frombuffer(mapping, dtype=torch.uint8)
        self.flats: list[torch.Tensor] = []
        offset = 0
        for size, dtype in zip(layout.sizes, layout.dtypes, strict=True):
            offset = _aligned(offset)
            nbytes = size * _itemsize(dtype)
            self.flats.append(raw[offset : offset + nbytes].view(dtype))
            offset += nbytes

    @classmethod
    def create(cls, layout: ShardLayout, label: str) -> SharedRegion:
        """A new region for ``layout`` (a file in the shared folder; call ``unlink`` once
        every peer attached). Not enough room raises ``OSError`` saying what to change."""
        nbytes = region_bytes(layout)
        path = SHARED_DIR / f"{NAME_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}-{label}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as error:
                os.unlink(path)
                if error.errno in (errno.ENOSPC, errno.EFBIG):
                    raise OSError(
                        error.errno,
                        f"{SHARED_DIR} has no room for a {nbytes / 2**20:.1f} MiB ps buffer (each "
                        "worker maps two per server, the size of that server's shard); enlarge "
                        f"it (Docker: --shm-size) or pass transport='gloo'.",
                    ) from None
                raise
            mapping = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        return cls(path, mapping, layout)

    @classmethod
    def attach(cls, path: str, layout: ShardLayout) -> SharedRegion:
        """Map a region a worker created for ``layout``; refuses any other file."""
        where = Path(path)
        if where.parent != SHARED_DIR or not where.name.startswith(NAME_PREFIX):
            raise ValueError(f"{path!r} is not a paratrain ps buffer in {SHARED_DIR}.")
        nbytes = region_bytes(layout)
        fd = os.open(where, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
        try:
            size = os.fstat(fd).st_size
            if size != nbytes:
                raise ValueError(
                    f"{path} holds {size} bytes, not the {nbytes} of this server's shard: it "
                    "was made for another model or another server."
                )
            mapping = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        return cls(where, mapping, layout)

    def unlink(self) -> None:
        """Delete the file; the mappings stay valid until every process drops them."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
