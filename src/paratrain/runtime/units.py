"""Byte sizes as people write them ("2GiB", "1.5GB") and as reports print them.

Why a parser of our own rather than accepting bare numbers only: a memory budget is
written in configs and on command lines, where "2GiB" is what users type and a typo such
as "2GIBB" must be refused loudly rather than read as something else. Single-letter
units ("2G") are refused on purpose: tools disagree on whether they mean 10^9 or 2^30.
"""

from __future__ import annotations

import re

_FACTORS = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")


def parse_size(value: str | int | None, *, name: str = "memory_per_device") -> int | None:
    """Bytes in ``value``: an int (bytes), or a string such as "2GiB", "512MiB", "1.5GB".

    ``None`` stays ``None`` (no size given). Anything else is refused with one sentence.
    """
    if value is None:
        return None
    refusal = ValueError(
        f"{name} must be a size such as '2GiB', '512MiB', '1.5GB' or a whole number of "
        f"bytes, not {value!r}."
    )
    if isinstance(value, bool):
        raise refusal
    if isinstance(value, int):
        if value < 1:
            raise refusal
        return value
    if not isinstance(value, str):
        raise refusal
    match = _SIZE.match(value)
    if match is None:
        raise refusal
    number, unit = match.groups()
    factor = _FACTORS.get(unit.lower() or "b")
    if factor is None or (factor == 1 and "." in number):
        raise refusal
    size = int(float(number) * factor)
    if size < 1:
        raise refusal
    return size


def format_bytes(count: float) -> str:
    """1536 -> '1.5 KiB': sizes from bytes to GiB, three significant figures.

    1000 to 1023 of a unit print whole ('1010 KiB'), not in exponent notation.
    """
    for unit in ("B", "KiB", "MiB"):
        if abs(count) < 1024:
            if unit == "B":
                return f"{int(count)} B"
            return f"{count:.3g} {unit}" if abs(count) < 1000 else f"{count:.0f} {unit}"
        count /= 1024
    return f"{count:,.3g} GiB" if abs(count) < 1000 else f"{count:,.0f} GiB"
