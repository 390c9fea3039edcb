"""A per-worker memory ledger: bytes by category, current and peak, and a budget.

Why categories rather than one number: the fix for running out of memory depends on what
grew. Parameters, gradients and optimizer state are what sharding strategies split;
activations are what recompute and smaller micro-batches shrink; communication buffers
are what bucket sizes and pipeline windows set. The ledger keeps each, as it is now and
at its highest, and the highest *sum* seen at one moment (the peaks of the categories
are not reached at the same time, so their sum would overstate the worker's peak).

The budget makes a CPU worker behave like a device of that size: an update that takes
the total over it raises ``DeviceOutOfMemory``, naming the worker, the category whose
growth crossed the line, the figures, and (through ``advice``) what would fit. On CUDA
the budget is at most the device's real size, and each record also carries the caching
allocator's own figures, so the two accounts can be compared.

The ledger only books what it is told; when to measure is the engine's business (see
``parallel/memory_tracking.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from paratrain.runtime.units import format_bytes, parse_size

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "communication")
LABELS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer": "optimizer state",
    "activations": "activations saved for backward",
    "communication": "communication buffers",
}


class DeviceOutOfMemory(RuntimeError):
    """A worker's ledger went over its memory budget; the message says what to change."""

    def __init__(
        self, message: str, *, worker: int, category: str, total: int, budget: int
    ) -> None:
        super().__init__(message)
        self.worker = worker
        self.category = category
        self.total = total
        self.budget = budget


def device_budget(
    memory_per_device: str | int | None, device: torch.device
) -> tuple[int | None, str]:
    """The byte budget of a worker on ``device``, and where that figure comes from.

    On CPU it is ``memory_per_device`` (or no budget). On CUDA it is the device's real
    size, or ``memory_per_device`` where that is smaller.
    """
    budget = parse_size(memory_per_device)
    if device.type != "cuda":
        return budget, "memory_per_device"
    physical = int(torch.cuda.get_device_properties(device).total_memory)
    if budget is None or budget >= physical:
        return physical, f"the memory of {torch.cuda.get_device_name(device)}"
    return budget, "memory_per_device"


class MemoryLedger:
    """Current and peak bytes per category for one worker, checked against a budget.

    ``advice(ledger, category)`` returns the closing clause of the out-of-memory message
    (which strategy would fit); it is called only when the budget is exceeded.
    """

    def __init__(
        self,
        *,
        worker: int,
        device: torch.device,
        budget: int | None = None,
        budget_source: str = "memory_per_device",
        advice: Callable[[MemoryLedger, str], str] | None = None,
    ) -> None:
        self.worker = worker
        self.device = device
        self.budget = budget
        self.budget_source = budget_source
        self.current = dict.fromkeys(CATEGORIES, 0)
        self.peak = dict.fromkeys(CATEGORIES, 0)
        self.peak_total = 0
        self.measured: set[str] = set()
        self._advice = advice

    @property
    def total(self) -> int:
        """Bytes held now, all categories together."""
        return sum(self.current.values())

    def update(self, **bytes_by_category: int) -> None:
        """Book the current size of some categories; raise if the total exceeds the budget."""
        unknown = sorted(set(bytes_by_category) - set(CATEGORIES))
        if unknown:
            raise ValueError(
                f"unknown memory categories {unknown}; use some of {', '.join(CATEGORIES)}."
            )
        growth = {}
        for category, value in bytes_by_category.items():
            value = int(value)
            growth[category] = value - self.current[category]
            self.current[category] = value
            self.peak[category] = max(self.peak[category], value)
            self.measured.add(category)
        total = self.total
        self.peak_total = max(self.peak_total, total)
        if self.budget is not None and total > self.budget and growth:
            culprit = max(growth, key=lambda c: (growth[c], self.current[c]))
            raise self._overflow(culprit, total)

    def _overflow(self, category: str, total: int) -> DeviceOutOfMemory:
        breakdown = ", ".join(
            f"{LABELS[c]} {format_bytes(self.current[c])}" for c in CATEGORIES if self.current[c]
        )
        advice = self.advice(category)
        shown_total, shown_budget = format_bytes(total), format_bytes(self.budget)
        if shown_total == shown_budget:  # rounded alike: show the bytes that differ
            shown_total, shown_budget = f"{total:,} B", f"{self.budget:,} B"
        message = (
            f"worker {self.worker} is out of memory: its {LABELS[category]} reached "
            f"{format_bytes(self.current[category])}, bringing its total to "
            f"{shown_total} ({breakdown}), over the {shown_budget} "
            f"budget set by {self.budget_source}" + (f"; {advice}." if advice else ".")
        )
        return DeviceOutOfMemory(
            message, worker=self.worker, category=category, total=total, budget=self.budget
        )

    def advice(self, category: str) -> str:
        """The closing clause of an out-of-memory sentence whose culprit is ``category``
        (which strategy would fit), or "" where the engine gave no adviser."""
        return self._advice(self, category) if self._advice else ""

    def record(self) -> dict[str, Any]:
        """The ledger as plain values (for metrics.jsonl and the run summary).

        Categories never measured are left out rather than reported as 0 bytes. On CUDA,
        ``cuda_allocated`` and ``cuda_peak_allocated`` are the caching allocator's figures.
        """
        shown = [c for c in CATEGORIES if c in self.measured]
        record: dict[str, Any] = {
            "worker": self.worker,
            "current": {c: self.current[c] for c in shown},
            "peak": {c: self.peak[c] for c in shown},
            "total": self.total,
            "peak_total": self.peak_total,
            "budget": self.budget,
        }
        if self.device.type == "cuda":
            record["cuda_allocated"] = int(torch.cuda.memory_allocated(self.device))
            record["cuda_peak_allocated"] = int(torch.cuda.max_memory_allocated(self.device))
        return record
