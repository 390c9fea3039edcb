"""A run folder's metrics, read once into what the report prints and draws.

The text summary, the picture and the comparison table all take their figures from here,
so they cannot disagree with each other; and the final figures come from the run's
``summary`` record, the one the console summary was printed from, so they agree with it
too (for ps that is the workers' summed throughput and their mean final loss, not worker
0's share).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paratrain.reports.metrics_file import read_metrics

__all__ = ["AttemptStart", "RunMetrics", "load_run"]


@dataclass(frozen=True)
class AttemptStart:
    """Where an attempt after the first took over: the step its checkpoint was saved at,
    the run's wall time then (the clock made continuous across attempts), and whether it
    was a restart after a failed worker (``--max-restarts``) or a resume the user asked for."""

    step: int
    time_s: float
    restart: bool


@dataclass
class RunMetrics:
    """One run's records, by kind; ``time_s`` of train and eval records made continuous
    across resumes (each attempt's writer starts its clock at 0)."""

    run_dir: Path
    config: dict[str, Any]
    """The settings of the run's last attempt (a resume may change the strategy and the
    worker count), which wrote the summary the console printed last."""
    workers: int | None
    train: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    memory: dict[int, dict[str, Any]]
    """Each worker's ledger record from the last attempt that wrote any, by worker."""
    summary: dict[str, Any] | None
    failures: list[str] = field(default_factory=list)
    """Each failed attempt's sentence (``{"kind": "failed"}`` records, see resume.py)."""
    display_name: str | None = None
    """How tables and legends name the run; default: its folder's name."""
    layouts: list[str] = field(default_factory=list)
    """Each attempt's layout in order (``dp on 2 worker(s)``): more than one for a run
    that was resumed or restarted."""
    attempts: list[AttemptStart] = field(default_factory=list)
    """Where each attempt after the first started (the plots mark them)."""
    worker_changes: list[dict[str, Any]] = field(default_factory=list)
    """The ``workers`` records (an elastic run's changes of worker count) since the last
    resume (a restart, ``attempt`` 1 and up, keeps them: under ``--elastic`` zero2's
    survivors restart), ``time_s`` made continuous like the curves' (the plots mark them)."""

    @property
    def name(self) -> str:
        return self.display_name or self.run_dir.name or str(self.run_dir)

    @property
    def strategy(self) -> str:
        return str(self.config.get("strategy", "?"))

    @property
    def strategy_metrics(self) -> dict[str, Any] | None:
        """What the strategy's ``run_metrics()`` reported (ps: pushes, staleness), if any."""
        if self.summary is None:
            return None
        value = self.summary.get(self.strategy)
        return value if isinstance(value, dict) else None

    @property
    def final_train_loss(self) -> float | None:
        """The console's final train loss: the summary's, else the last logged."""
        if self.summary is not None and self.summary.get("final_train_loss") is not None:
            return float(self.summary["final_train_loss"])
        return float(self.train[-1]["loss"]) if self.train else None

    @property
    def final_eval_loss(self) -> float | None:
        if self.summary is not None and self.summary.get("final_eval_loss") is not None:
            return float(self.summary["final_eval_loss"])
        return float(self.evals[-1]["eval_loss"]) if self.evals else None

    @property
    def samples_per_s(self) -> float | None:
        """The console's throughput (all workers'); None for a run that did not finish."""
        if self.summary is None or self.summary.get("samples_per_s") is None:
            return None
        return float(self.summary["samples_per_s"])

    @property
    def per_step_throughput_is_share(self) -> bool:
        """Whether the train records' samples/s are worker 0's share of the run's (workers
        that never wait on each other each log their own pace)."""
        return bool(self.summary and "worker_samples_per_s" in self.summary)

    def best_loss(self) -> tuple[str, float, int, float] | None:
        """``(which, loss, step, seconds)``: the lowest eval loss (train loss where the run
        never evaluated), the step it was logged at and the wall time it took to reach it."""
        kind, key, records = ("eval", "eval_loss", self.evals)
        if not records:
            kind, key, records = ("train", "loss", self.train)
        if not records:
            return None
        best = min(records, key=lambda r: r[key])  # the first of equal losses: the earliest
        return kind, float(best[key]), int(best["step"]), float(best["time_s"])

    @property
    def has_accuracy(self) -> bool:
        return any("accuracy" in r for r in (*self.train, *self.evals))


def load_run(run_dir: str | Path) -> RunMetrics:
    """Read ``run_dir/metrics.jsonl``; refuses a folder without one in one sentence."""
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"{run_dir} holds no metrics.jsonl; pass the folder of a paratrain run."
        )
    records = read_metrics(path)
    configs = [r for r in records if r["kind"] == "config"]
    train: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    memory: dict[int, dict[str, Any]] = {}
    attempt_memory: dict[int, dict[str, Any]] = {}
    summary = None
    failures: list[str] = []
    attempts: list[AttemptStart] = []
    changes: list[dict[str, Any]] = []
    unplaced: dict[str, Any] | None = None  # an attempt recorded without its start step
    offset = last = 0.0
    for record in records:
        kind = record["kind"]
        if kind == "config":
            attempt_memory = {}  # a new attempt: another layout may have other workers
            if not record.get("attempt"):  # a resume starts the count afresh; a restart not
                changes = []
            if record is not configs[0]:
                offset = last  # a resumed attempt's clock starts at 0 again
                unplaced = _attempt_start(record, offset, attempts)
        elif kind in ("train", "eval"):
            if "time_s" in record:  # absent in files written before it was logged
                last = offset + float(record["time_s"])
            (train if kind == "train" else evals).append({**record, "time_s": last})
            if unplaced is not None:  # files before start_step: its first logged step
                attempts.append(AttemptStart(int(record["step"]), offset, unplaced["restart"]))
                unplaced = None
        elif kind == "workers":
            changes.append({**record, "time_s": offset + float(record.get("time_s", 0.0))})
        elif kind == "memory":
            attempt_memory[int(record["worker"])] = record
            memory = attempt_memory
        elif kind == "summary":
            summary = record
        elif kind == "failed":
            failures.append(str(record.get("error", "")))
    latest = configs[-1] if configs else {}
    return RunMetrics(
        run_dir=run_dir,
        config=latest.get("config", {}),
        workers=latest.get("workers"),
        train=train,
        evals=evals,
        memory=dict(sorted(memory.items())),
        summary=summary,
        failures=failures,
        layouts=[_layout(record) for record in configs],
        attempts=attempts,
        worker_changes=changes,
    )


def _attempt_start(
    config_record: dict[str, Any], offset: float, attempts: list[AttemptStart]
) -> dict[str, Any] | None:
    """Record where the attempt this config record opens started; an attempt written
    before ``start_step`` was recorded is returned, to be placed at its first logged step."""
    restart = int(config_record.get("attempt", 0)) > 0
    if "start_step" in config_record:
        attempts.append(AttemptStart(int(config_record["start_step"]), offset, restart))
        return None
    return {"restart": restart}


def _layout(config_record: dict[str, Any]) -> str:
    strategy = config_record.get("config", {}).get("strategy", "?")
    workers = config_record.get("workers")
    return f"{strategy} on {workers if workers is not None else '?'} worker(s)"
