"""Choosing a plan from predictions: a pure function from candidates to a ranked answer.

Every candidate (a strategy, its options, the accumulation and precision) carries its
prediction (``parallel/cost_model.Prediction``) or the reason it could not be made. A
candidate fits where its predicted peak, raised by ``MARGIN`` (the accuracy the
predictions are held to), is within the budget, so that a plan said to fit does not run
out of memory when the prediction is off by that much; among those that fit the fastest
predicted step wins, the smaller peak breaking a tie. Every other candidate is told why it
lost: over the budget (by how much), or slower than the chosen one (by how much).

Nothing here measures or runs: the planner's tests feed it synthetic predictions with
known answers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from paratrain.parallel.cost_model import CATEGORIES, Prediction
from paratrain.parallel.live_cost import TRANSIENT
from paratrain.parallel.registry import strategy_class
from paratrain.runtime.units import format_bytes

MARGIN = 0.10
"""A plan fits where predicted peak x (1 + MARGIN) <= budget."""


class NoPlanFits(ValueError):
    """No candidate fits the budget; the message names the smallest one and its need."""

    def __init__(self, message: str, *, candidates: list[Candidate], smallest: Candidate):
        super().__init__(message)
        self.candidates = candidates
        self.smallest = smallest


@dataclass
class Candidate:
    """One way to run: ``strategy`` with ``options`` (as ``setup`` takes them)."""

    strategy: str
    options: dict[str, Any]
    gradient_accumulation: int = 1
    precision: str = "fp32"
    prediction: Prediction | None = None
    invalid: str | None = None
    """Why no prediction could be made (a layout the model cannot take)."""
    verdict: str = ""
    """Filled by ``rank``: "chosen", or why not."""

    @property
    def setup_options(self) -> dict[str, Any]:
        """Exactly what ``paratrain.setup`` takes beside the model, optimizer and loss."""
        out = dict(self.options)
        out["gradient_accumulation"] = self.gradient_accumulation
        out["precision"] = self.precision
        return out

    def mesh(self, devices: int) -> str:
        """replicas x stages x tensor, as the strategy lays out ``devices`` workers."""
        layout = strategy_class(self.strategy).layout(devices, self.options)
        return "x".join(str(degree) for degree in layout.as_tuple())

    def describe_options(self) -> str:
        parts = []
        for key in ("micro_batches", "schedule", "virtual_stages", "recompute", "balance_by"):
            if key in self.options:
                value = self.options[key]
                parts.append(key if value is True else f"{key}={value}")
        if self.gradient_accumulation > 1:
            parts.append(f"accumulation={self.gradient_accumulation}")
        if self.precision != "fp32":
            parts.append(self.precision)
        return ", ".join(parts) or "-"

    @property
    def peak(self) -> int | None:
        return None if self.prediction is None else self.prediction.peak_bytes


def fits(candidate: Candidate, budget: int | None) -> bool:
    if candidate.prediction is None:
        return False
    return budget is None or candidate.peak * (1 + MARGIN) <= budget


def rank(candidates: list[Candidate], budget: int | None, devices: int) -> Candidate:
    """The chosen candidate; every candidate's ``verdict`` says what became of it. Raises
    ``NoPlanFits`` (naming the smallest need) where none fits."""
    predicted = [c for c in candidates if c.prediction is not None]
    for candidate in candidates:
        if candidate.invalid:
            candidate.verdict = f"cannot run: {candidate.invalid}"
    if not predicted:
        reasons = sorted({c.invalid for c in candidates if c.invalid})
        raise ValueError(
            "no candidate could be predicted for this model"
            + (f" ({reasons[0]})" if reasons else "")
            + "; fix the model or the options the first reason names."
        )
    fitting = [c for c in predicted if fits(c, budget)]
    for candidate in predicted:
        if not fits(candidate, budget):
            need = candidate.peak * (1 + MARGIN)
            candidate.verdict = (
                f"over budget: needs {format_bytes(candidate.peak)} "
                f"(+{MARGIN:.0%}: {format_bytes(need)}) > {format_bytes(budget)}"
            )
    if not fitting:
        smallest = min(predicted, key=lambda c: (c.peak, c.prediction.step_s))
        options = smallest.describe_options()
        raise NoPlanFits(
            f"no plan fits {format_bytes(budget)} per worker: the smallest, {smallest.strategy} "
            f"on {smallest.mesh(devices)} (replicas x stages x tensor)"
            + (f" with {options}" if options != "-" else "")
            + f", needs {format_bytes(smallest.peak)} per worker "
            f"({format_bytes(smallest.peak * (1 + MARGIN))} with the {MARGIN:.0%} margin); "
            "give each worker that much, or more workers.",
            candidates=candidates,
            smallest=smallest,
        )
    chosen = min(fitting, key=lambda c: (c.prediction.step_s, c.peak))
    for candidate in fitting:
        if candidate is chosen:
            candidate.verdict = "chosen"
        else:
            slower = candidate.prediction.step_s / chosen.prediction.step_s
            candidate.verdict = f"fits; {slower:.2f}x the chosen step time"
    return chosen


@dataclass
class Plan:
    """The answer: what to pass to ``setup``, what it will hold and take, and why.

    ``setup(model, optimizer=..., loss_fn=..., strategy=plan.strategy, **plan.options)``.
    """

    strategy: str
    options: dict[str, Any]
    predicted_memory: dict[str, int]
    """Per worker (the one that peaks highest), by ledger category, at the peak."""
    predicted_step_s: float
    devices: int
    global_batch: int
    budget: int | None
    candidates: list[Candidate] = field(default_factory=list)
    notes: tuple[str, ...] = ()

    @property
    def predicted_peak_bytes(self) -> int:
        return sum(self.predicted_memory.values())

    @classmethod
    def of(cls, chosen: Candidate, candidates: list[Candidate], **context: Any) -> Plan:
        return cls(
            strategy=chosen.strategy,
            options=chosen.setup_options,
            predicted_memory=dict(chosen.prediction.memory),
            predicted_step_s=chosen.prediction.step_s,
            candidates=candidates,
            notes=chosen.prediction.notes,
            **context,
        )

    def summary(self) -> str:
        """Two lines: the choice, and its prediction."""
        shown = ", ".join(
            f"{k}={v}" for k, v in self.options.items() if (k, v) not in DEFAULT_SHOWN
        )
        breakdown = ", ".join(
            f"{c} {format_bytes(self.predicted_memory[c])}"
            for c in (*CATEGORIES, TRANSIENT)
            if self.predicted_memory.get(c)
        )
        return (
            f"plan: strategy {self.strategy}" + (f" ({shown})" if shown else "") + "\n"
            f"predicted: {format_bytes(self.predicted_peak_bytes)} peak per worker ({breakdown}); "
            f"{self.predicted_step_s:.3f} s per step, "
            f"{self.global_batch / self.predicted_step_s:,.1f} samples/s"
        )

    def table(self) -> str:
        """Every candidate: mesh (replicas x stages x tensor), options, predicted peak per
        worker and step time, and what became of it; the chosen one first, then the
        others that fit by speed, then the rest by need."""
        return format_table(self.candidates, self.devices, self.global_batch)


DEFAULT_SHOWN = {("gradient_accumulation", 1), ("precision", "fp32")}


def _order(candidate: Candidate) -> tuple:
    if candidate.verdict == "chosen":
        return (0, 0.0, 0)
    if candidate.prediction is None:
        return (3, 0.0, 0)
    if candidate.verdict.startswith("fits"):
        return (1, candidate.prediction.step_s, candidate.peak)
    return (2, candidate.peak, 0)


def format_table(candidates: list[Candidate], devices: int, global_batch: int) -> str:
    rows = [("strategy", "mesh", "options", "peak/worker", "step s", "samples/s", "verdict")]
    for c in sorted(candidates, key=_order):
        if c.prediction is None:
            rows.append(
                (c.strategy, c.mesh(devices), c.describe_options(), "-", "-", "-", c.verdict)
            )
            continue
        step = c.prediction.step_s
        rows.append(
            (
                c.strategy,
                c.mesh(devices),
                c.describe_options(),
                format_bytes(c.peak),
                f"{step:.3f}",
                f"{global_batch / step:,.1f}",
                c.verdict,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
