"""The run's metrics file: one JSON object per line, appended as training goes.

JSON lines because a run that dies mid-way still leaves every line it wrote readable, and
because any tool (pandas, jq, a plotting script) reads it without paratrain.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from paratrain.runtime.units import format_bytes

__all__ = ["MetricsWriter", "format_bytes", "read_metrics", "summarize_metrics"]


class MetricsWriter:
    """Appends records to ``path``, each stamped with seconds since the writer started."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._handle = self.path.open("a", buffering=1)
        self._start = time.monotonic()

    def write(self, kind: str, **values: Any) -> None:
        record = {"kind": kind, "time_s": round(time.monotonic() - self._start, 4), **values}
        self._handle.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._handle.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a metrics file, in order."""
    with Path(path).open() as handle:
        return [json.loads(line) for line in handle if line.strip()]


def summarize_metrics(path: str | Path) -> str:
    """The headline figures of a metrics file, as ``paratrain report`` prints them."""
    records = read_metrics(path)
    config = next((r for r in records if r["kind"] == "config"), {})
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    settings = config.get("config", {})
    lines = [
        f"paratrain report {Path(path).parent}: {settings.get('model', '?')} on "
        f"{settings.get('dataset', '?')}, strategy {settings.get('strategy', '?')}, "
        f"{config.get('workers', '?')} worker(s)"
    ]
    if train:
        last = train[-1]
        lines.append(f"  steps logged        {len(train)} (last step {last['step']})")
        lines.append(f"  train loss          {train[0]['loss']:.4f} -> {last['loss']:.4f}")
        lines.append(f"  samples/s           {last['samples_per_s']:,.1f}")
    if evals:
        lines.append(
            f"  eval loss           {evals[-1]['eval_loss']:.4f} (step {evals[-1]['step']})"
        )
    if train and train[-1].get("skipped_steps"):
        lines.append(f"  skipped steps       {train[-1]['skipped_steps']} (fp16 overflow)")
    lines += [_memory_line(r) for r in records if r["kind"] == "memory"]
    lines += [f"  failed              {r['error']}" for r in records if r["kind"] == "failed"]
    return "\n".join(lines)


def _memory_line(record: dict[str, Any]) -> str:
    """One worker's ledger: peak total, then each category's peak."""
    parts = ", ".join(f"{name} {format_bytes(value)}" for name, value in record["peak"].items())
    budget = f" of {format_bytes(record['budget'])}" if record.get("budget") else ""
    return (
        f"  memory worker {record['worker']:<5}peak {format_bytes(record['peak_total'])}{budget}"
        + (f" ({parts})" if parts else "")
    )
