"""The text ``paratrain report RUN_DIR`` prints: the run's headline figures.

Final loss and throughput are the summary record's, the ones the console printed at the
end of ``paratrain train``; the strategy adds its own lines (ps: servers, pushes per
worker, the staleness histogram) through the same ``summary_lines`` the console uses.
"""

from __future__ import annotations

from typing import Any

from paratrain.parallel import strategy_class, strategy_names
from paratrain.reports.run_data import RunMetrics
from paratrain.reports.worker_changes import counts_line
from paratrain.runtime.units import format_bytes

__all__ = ["summarize_run"]


def summarize_run(run: RunMetrics) -> str:
    """The headline figures of one run, as ``paratrain report`` prints them."""
    settings = run.config
    lines = [
        f"paratrain report {run.run_dir}: {settings.get('model', '?')} on "
        f"{settings.get('dataset', '?')}, strategy {run.strategy}, "
        f"{run.workers if run.workers is not None else '?'} worker(s)"
    ]
    if len(run.layouts) > 1:  # resumed or restarted: the header is the last attempt's
        lines.append(f"  attempts            {' -> '.join(run.layouts)}")
    if run.worker_changes and run.workers is not None:
        lines.append(f"  workers             {counts_line(run.workers, run.worker_changes)}")
    if run.train:
        last = run.train[-1]
        lines.append(f"  steps logged        {len(run.train)} (last step {last['step']})")
        lines.append(
            f"  train loss          {run.train[0]['loss']:.4f} -> {run.final_train_loss:.4f}"
        )
    if run.final_eval_loss is not None:
        step = f" (step {run.evals[-1]['step']})" if run.evals else ""
        lines.append(f"  eval loss           {run.final_eval_loss:.4f}{step}")
    best = run.best_loss()
    if best is not None:
        kind, loss, step, seconds = best
        label = f"best {kind} loss"
        lines.append(f"  {label:<20}{loss:.4f} at step {step}, {seconds:.2f} s in")
    lines += _accuracy_lines(run)
    lines += _throughput_lines(run)
    if run.train and run.train[-1].get("skipped_steps"):
        lines.append(f"  skipped steps       {run.train[-1]['skipped_steps']} (fp16 overflow)")
    lines += [memory_line(record) for record in run.memory.values()]
    metrics = run.strategy_metrics
    if metrics is not None and run.strategy in strategy_names():
        lines += strategy_class(run.strategy).summary_lines(metrics)
    lines += [f"  failed              {error}" for error in run.failures]
    return "\n".join(lines)


def _accuracy_lines(run: RunMetrics) -> list[str]:
    lines = []
    for label, records in (("train accuracy", run.train), ("eval accuracy", run.evals)):
        scored = [r for r in records if "accuracy" in r]
        if scored:
            lines.append(f"  {label:<20}{scored[-1]['accuracy']:.2%} (step {scored[-1]['step']})")
    return lines


def _throughput_lines(run: RunMetrics) -> list[str]:
    if run.samples_per_s is None:
        if not run.train:
            return []
        return [
            f"  samples/s           {run.train[-1]['samples_per_s']:,.1f} "
            "(last logged; the run wrote no summary)"
        ]
    line = f"  samples/s           {run.samples_per_s:,.1f}"
    shares = (run.summary or {}).get("worker_samples_per_s")
    if shares:
        parts = ", ".join(
            f"worker {w}: {r:,.1f}" for w, r in sorted(shares.items(), key=lambda i: int(i[0]))
        )
        line += f" (the workers' sum: {parts})"
    return [line]


def memory_line(record: dict[str, Any]) -> str:
    """One worker's ledger: peak total, then each category's peak; "not measured" where
    the engine keeps no ledger (rather than a misleading 0 B)."""
    label = f"  {'memory worker ' + str(record['worker']):<20}"
    if not record.get("peak"):
        return label + "not measured (this engine keeps no memory ledger)"
    parts = ", ".join(f"{name} {format_bytes(value)}" for name, value in record["peak"].items())
    budget = f" of {format_bytes(record['budget'])}" if record.get("budget") else ""
    return f"{label}peak {format_bytes(record['peak_total'])}{budget} ({parts})"
