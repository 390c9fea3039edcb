"""The run's metrics file: one JSON object per line, appended as training goes.

JSON lines because a run that dies mid-way still leaves every line it wrote readable, and
because any tool (pandas, jq, a plotting script) reads it without paratrain.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from paratrain.runtime.units import format_bytes  # re-exported: the CLI's byte figures

__all__ = [
    "MetricsWriter",
    "append_records",
    "format_bytes",
    "read_metrics",
]


class MetricsWriter:
    """Appends records to ``path``, each stamped with seconds since the writer started."""

    def __init__(self, path: str | Path, mirror: Any = None, start: float | None = None) -> None:
        """``start``: the ``time.monotonic()`` the stamps count from (default: now); a
        worker that takes over the file (elastic, the lead died) passes its run's start, so
        the stamps go on rather than restart at 0."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._handle = self.path.open("a", buffering=1)
        self._start = time.monotonic() if start is None else start
        self._mirror = mirror
        """Another sink that sees every record too (``TensorBoardMirror``), or None."""

    def write(self, kind: str, **values: Any) -> None:
        record = {"kind": kind, "time_s": round(time.monotonic() - self._start, 4), **values}
        self._handle.write(json.dumps(record) + "\n")
        if self._mirror is not None:
            self._mirror.write(kind, values)

    def close(self) -> None:
        self._handle.close()
        if self._mirror is not None:
            self._mirror.close()


def append_records(path: str | Path, records: list[dict[str, Any]]) -> None:
    """Append whole records (each with its ``kind``) to a metrics file another writer
    closed: the parent's records of a run whose workers write only their own."""
    with Path(path).open("a") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a metrics file, in order."""
    with Path(path).open() as handle:
        return [json.loads(line) for line in handle if line.strip()]
