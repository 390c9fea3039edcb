"""The table ``paratrain report RUN_A RUN_B ...`` prints: one row per run.

Final losses and samples/s are the runs' summary figures (what each console printed);
"time to best" is the wall time, since the run's training started, at which the run
logged its lowest eval loss (its lowest train loss where it never evaluated). The table
says which loss each row used, since the two are not comparable with each other. The
workers column is the last attempt's worker count, or an elastic run's counts in turn
(``4->3->4``): a throughput is read against how many workers earned it.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.reports.run_data import RunMetrics
from paratrain.reports.worker_changes import worker_counts

__all__ = ["CompareRow", "compare_rows", "format_compare"]


@dataclass(frozen=True)
class CompareRow:
    run: str
    strategy: str
    workers: str
    final_train_loss: float | None
    final_eval_loss: float | None
    samples_per_s: float | None
    best_kind: str | None
    best_loss: float | None
    best_step: int | None
    time_to_best_s: float | None


def compare_rows(runs: list[RunMetrics]) -> list[CompareRow]:
    """One row of headline figures per run, in the order given."""
    rows = []
    for run in runs:
        best = run.best_loss()
        kind, loss, step, seconds = best if best is not None else (None, None, None, None)
        rows.append(
            CompareRow(
                run=run.name,
                strategy=run.strategy,
                workers=_workers(run),
                final_train_loss=run.final_train_loss,
                final_eval_loss=run.final_eval_loss,
                samples_per_s=run.samples_per_s,
                best_kind=kind,
                best_loss=loss,
                best_step=step,
                time_to_best_s=seconds,
            )
        )
    return rows


def format_compare(rows: list[CompareRow]) -> str:
    """The rows as an aligned text table; '-' where a run has no such figure."""
    header = (
        "run",
        "strategy",
        "workers",
        "final train",
        "final eval",
        "samples/s",
        "best loss",
        "at step",
        "time to best",
    )
    table = [header]
    for row in rows:
        best = f"{row.best_loss:.4f} ({row.best_kind})" if row.best_loss is not None else "-"
        table.append(
            (
                row.run,
                row.strategy,
                row.workers,
                _number(row.final_train_loss, "{:.4f}"),
                _number(row.final_eval_loss, "{:.4f}"),
                _number(row.samples_per_s, "{:,.1f}"),
                best,
                _number(row.best_step, "{}"),
                _number(row.time_to_best_s, "{:.2f} s"),
            )
        )
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    lines = [
        "  ".join(
            cell.ljust(width) if i < 2 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(line, widths, strict=True))
        ).rstrip()
        for line in table
    ]
    return "\n".join(lines)


def _workers(run: RunMetrics) -> str:
    if run.workers is None:
        return "-"
    return "->".join(map(str, worker_counts(run.workers, run.worker_changes)))


def _number(value: float | int | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)
