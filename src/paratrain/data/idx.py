"""Reader for the IDX format that MNIST and Fashion-MNIST are published in.

An IDX file is a 4-byte magic number (two zero bytes, a type code, the number of
dimensions), one big-endian ``uint32`` per dimension, then the values in big-endian
row-major order. The reader checks all of it, because a truncated or wrong file must
fail here with the file's name rather than later as a baffling reshape error.
"""

from __future__ import annotations

import gzip
import sys
import zlib
from math import prod
from pathlib import Path
from typing import NoReturn

import torch

__all__ = ["read_idx", "write_idx"]

_GZIP_MAGIC = b"\x1f\x8b"

# IDX type code -> (torch dtype, bytes per value)
_TYPES: dict[int, tuple[torch.dtype, int]] = {
    0x08: (torch.uint8, 1),
    0x09: (torch.int8, 1),
    0x0B: (torch.int16, 2),
    0x0C: (torch.int32, 4),
    0x0D: (torch.float32, 4),
    0x0E: (torch.float64, 8),
}


def read_idx(path: str | Path) -> torch.Tensor:
    """Read an IDX file (gzip-compressed or not, detected from its content) as a tensor
    with the file's own shape and dtype (``uint8`` for (Fashion-)MNIST)."""
    path = Path(path)
    data = _read_bytes(path)
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        _malformed(path, "it does not start with the IDX magic number (two zero bytes)")
    code, ndim = data[2], data[3]
    if code not in _TYPES:
        _malformed(path, f"its type code 0x{code:02x} is not one IDX defines")
    if ndim == 0:
        _malformed(path, "it declares zero dimensions")
    header = 4 + 4 * ndim
    if len(data) < header:
        _malformed(path, f"it ends inside its header ({len(data)} bytes for {ndim} dimensions)")
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    dtype, itemsize = _TYPES[code]
    expected = header + prod(dims) * itemsize
    if len(data) != expected:
        _malformed(
            path,
            f"its header promises shape {tuple(dims)} ({expected} bytes) but it has "
            f"{len(data)} bytes",
        )
    raw = torch.frombuffer(bytearray(data[header:]), dtype=torch.uint8)
    if itemsize > 1 and sys.byteorder == "little":
        raw = raw.reshape(-1, itemsize).flip(-1).reshape(-1)
    return raw.view(dtype).reshape(dims).clone()


def write_idx(path: str | Path, tensor: torch.Tensor, *, compress: bool | None = None) -> Path:
    """Write ``tensor`` as an IDX file (gzip when ``compress`` or the name ends in .gz).

    The inverse of :func:`read_idx`; it lets tests and users build small
    Fashion-MNIST-shaped files without the real download.
    """
    path = Path(path)
    codes = {dtype: code for code, (dtype, _) in _TYPES.items()}
    if tensor.dtype not in codes or tensor.dim() == 0:
        raise ValueError(
            f"IDX stores a tensor of at least one dimension with dtype in "
            f"{sorted(str(d) for d in codes)}; got {tensor.dtype} with shape {tuple(tensor.shape)}."
        )
    values = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    itemsize = tensor.element_size()
    if itemsize > 1 and sys.byteorder == "little":
        values = values.reshape(-1, itemsize).flip(-1).reshape(-1)
    header = bytes([0, 0, codes[tensor.dtype], tensor.dim()])
    header += b"".join(int(d).to_bytes(4, "big") for d in tensor.shape)
    payload = header + bytes(values.tolist())  # fine for the small files this is for
    if compress is None:
        compress = path.suffix == ".gz"
    path.write_bytes(gzip.compress(payload, mtime=0) if compress else payload)
    return path


def _read_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    if data[:2] != _GZIP_MAGIC:
        return data
    try:
        return gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as exc:
        _malformed(path, f"its gzip stream is damaged ({exc})")


def _malformed(path: Path, reason: str) -> NoReturn:
    raise ValueError(
        f"{path} is not a valid IDX file: {reason}; delete it so that it is downloaded "
        "again, or check that it is an (uncorrupted) MNIST-format file."
    )
