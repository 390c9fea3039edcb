"""What a finished run reports (``RunResult``), gathered from every worker's report.

Workers that wait on each other agree on the figures, so rank 0's report is the run's;
workers that never wait on each other (ps) train at their own pace, so the run's figures
are theirs combined, and the parent writes the records rank 0 could not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paratrain.config import TrainConfig
from paratrain.parallel import strategy_class
from paratrain.reports.metrics_file import append_records
from paratrain.reports.run_data import load_run
from paratrain.run.prepare import PreparedRun
from paratrain.runtime.launch import LostWorker


@dataclass
class RunResult:
    """What a finished run reports; also printed as the closing summary."""

    config: TrainConfig
    devices: int
    run_dir: Path
    final_train_loss: float
    final_eval_loss: float | None
    samples_per_s: float
    peak_memory_bytes: list[int]
    parameter_bytes: list[int]
    model_state_bytes: list[dict[str, int]]
    activation_peak_bytes: list[int | None]
    checkpoint: Path
    metrics: Path
    sample_text: str | None = None
    memory: list[dict[str, Any]] = field(default_factory=list)
    """Each worker's memory ledger (``MemoryLedger.record()``), in rank order."""
    skipped_steps: int = 0
    """Steps skipped because fp16 gradients overflowed."""
    steps: int = 0
    """Optimizer steps the run was set to take (``--steps``, or ``--epochs`` made steps)."""
    final_accuracy: float | None = None
    """The last evaluation's accuracy (classification datasets)."""
    loss_scale: float = 1.0
    preempted_at: int | None = None
    """The step after which a SIGTERM stopped the run (its checkpoint is ``checkpoint``)."""
    restarts: int = 0
    """Relaunches after a failed worker (``--max-restarts``) the run took to finish."""
    resumed: str | None = None
    """Where a resumed run came from (``resume_line``); None for a fresh run."""
    extra: dict[str, Any] = field(default_factory=dict)
    plan: Any = None
    """The planner's choice and prediction where the run asked for ``--strategy auto``."""
    worker_changes: list[dict[str, Any]] = field(default_factory=list)
    """An elastic run's changes of worker count (its ``workers`` records), in order."""


def collect_result(run: PreparedRun, run_dir: Path, reports: list[Any]) -> RunResult:
    """The run's result from the workers' reports (a ``LostWorker`` for each lost one)."""
    config = run.config
    # Inside torchrun, ranks other than 0 get their own report only (see external_job).
    reports = [r for r in reports if r is not None]
    lost = {r.rank: r.reason for r in reports if isinstance(r, LostWorker)}
    lead = next(r for r in reports if not isinstance(r, LostWorker))
    reports = [_lost_report(lead) if isinstance(r, LostWorker) else r for r in reports]
    result = RunResult(
        config=config,
        devices=run.devices,
        run_dir=run_dir,
        final_train_loss=lead["final_train_loss"],
        final_eval_loss=lead["final_eval_loss"],
        samples_per_s=lead["samples_per_s"],
        peak_memory_bytes=[r["peak_memory_bytes"] for r in reports],
        parameter_bytes=[r["parameter_bytes"] for r in reports],
        model_state_bytes=[r["model_state_bytes"] for r in reports],
        activation_peak_bytes=[r["activation_peak_bytes"] for r in reports],
        checkpoint=Path(lead["checkpoint"]),
        metrics=Path(lead["metrics"]),
        memory=[r["memory"] for r in reports],
        skipped_steps=lead["skipped_steps"],
        loss_scale=lead["loss_scale"],
        steps=run.length.steps,
        restarts=lead.get("restarts", 0),
        final_accuracy=lead["final_accuracy"],
        preempted_at=lead["preempted_at"],
        resumed=run.resumed,
        plan=run.plan,
        worker_changes=load_run(run_dir).worker_changes if config.elastic else [],
    )
    if strategy_class(config.strategy).independent_workers:
        _independent_result(result, [r for r in reports if r["rank"] is not None], lost)
    if config.strategy in lead:  # what the engine's run_metrics() returned
        result.extra[config.strategy] = lead[config.strategy]
    if strategy_class(config.strategy).independent_workers:
        _write_independent(result, lead, reports, lost)
    return result


def _lost_report(lead: dict[str, Any]) -> dict[str, Any]:
    """The report of a worker lost in a ps run: nothing measured."""
    return {
        **dict.fromkeys(lead),
        "model_state_bytes": dict.fromkeys(lead["model_state_bytes"]),
        "memory": {},
    }


def _independent_result(
    result: RunResult, live: list[dict[str, Any]], lost: dict[int, str]
) -> None:
    """Workers that never wait on each other (ps) train at their own pace on their shares,
    so the run's throughput is the sum of the workers' and its train loss the mean of their
    last shares' losses. Each worker skips its own overflowing fp16 steps, so skipped steps
    add up too."""
    result.samples_per_s = sum(r["samples_per_s"] for r in live)
    result.skipped_steps = sum(r["skipped_steps"] for r in live)
    result.final_train_loss = sum(r["final_train_loss"] for r in live) / len(live)
    result.extra["lost_workers"] = lost


def _write_independent(
    result: RunResult,
    lead: dict[str, Any],
    reports: list[dict[str, Any]],
    lost: dict[int, str],
) -> None:
    """The records rank 0 cannot write for workers that never wait on each other: every
    live worker's memory ledger and the run's summary, with the figures the console prints
    (the workers' summed throughput, their mean final loss), each worker's own beside them.
    """
    live = [r for r in reports if r["rank"] is not None and r["rank"] not in lost]
    summary = {k: v for k, v in lead.items() if k not in ("rank", "memory")}
    summary.update(
        final_train_loss=result.final_train_loss,
        samples_per_s=result.samples_per_s,
        skipped_steps=result.skipped_steps,
        worker_samples_per_s={r["rank"]: r["samples_per_s"] for r in live},
        worker_final_train_loss={r["rank"]: r["final_train_loss"] for r in live},
        lost_workers=lost,
    )
    records = [{"kind": "memory", **r["memory"]} for r in live if r["memory"]]
    append_records(result.metrics, [*records, {"kind": "summary", **summary}])
