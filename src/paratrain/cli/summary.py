"""The closing summary ``paratrain train`` prints: the run's figures, per worker where
they differ, what the strategy reports of itself, and the plan beside the measurement."""

from __future__ import annotations

from paratrain.parallel import strategy_class
from paratrain.reports.metrics_file import format_bytes
from paratrain.reports.worker_changes import counts_line, worker_counts


def _per_worker(label: str, values: list) -> list[str]:
    """One summary line of per-worker byte counts; none where the engine does not measure it."""
    if any(value is None for value in values):
        return []
    joined = ", ".join(f"worker {rank}: {format_bytes(value)}" for rank, value in enumerate(values))
    return [f"  {label:<18}{joined}"]


def _strategy_lines(result) -> list[str]:
    """What the run's strategy reports of itself, then any worker the run lost."""
    strategy = result.config.strategy
    metrics = result.extra.get(strategy)
    lines = strategy_class(strategy).summary_lines(metrics) if metrics else []
    for rank, reason in sorted(result.extra.get("lost_workers", {}).items()):
        lines.append(f"  lost worker       {rank}: {reason}")
    return lines


def _peak(record: dict, category: str) -> int | None:
    """A category's peak in a ledger record; None where the engine never measured it."""
    return record.get("peak", {}).get(category)


def _steps_run(result) -> str:
    """``100 steps``, or for a run SIGTERM stopped early, how far of how many it got
    (the configured length alone would claim steps that never ran)."""
    if result.preempted_at is None:
        return f"{result.steps} steps"
    return f"{result.preempted_at} of {result.steps} steps (stopped by SIGTERM)"


def _workers(result) -> str:
    """The worker count, or an elastic run's counts in turn (``4 -> 3 -> 4``)."""
    return " -> ".join(map(str, worker_counts(result.devices, result.worker_changes)))


def format_summary(result) -> str:
    """The closing summary a user reads after ``paratrain train``."""
    config = result.config
    lines = [
        f"paratrain train: {config.model} on {config.dataset}, strategy {config.strategy}, "
        f"{_workers(result)} worker(s), {_steps_run(result)}"
        + (f" ({config.epochs} epoch{'s' * (config.epochs > 1)})" if config.epochs else "")
        + f", global batch {config.global_batch}",
        f"  final train loss  {result.final_train_loss:.4f}",
    ]
    if result.resumed:
        lines.insert(1, f"  resumed {result.resumed}")
    if result.worker_changes:
        lines.insert(1, f"  workers           {counts_line(result.devices, result.worker_changes)}")
    if result.restarts:
        where = "its last checkpoint after a failed worker (--max-restarts)"
        lines.insert(1, f"  restarted {result.restarts} time(s) from {where}")
    if result.final_eval_loss is not None:
        lines.append(f"  final eval loss   {result.final_eval_loss:.4f}")
    if result.final_accuracy is not None:
        lines.append(f"  final accuracy    {100 * result.final_accuracy:.2f}%")
    lines.append(f"  throughput        {result.samples_per_s:,.1f} samples/s")
    if config.precision != "fp32":
        lines.append(f"  precision         {config.precision}")
    if config.precision == "fp16":
        lines.append(
            f"  skipped steps     {result.skipped_steps} (inf/NaN gradients; "
            f"loss scale now {result.loss_scale:g})"
        )
    lines += _per_worker("peak memory", result.peak_memory_bytes)
    lines += _per_worker("parameters held", result.parameter_bytes)
    lines += _per_worker("gradients held", [m["gradients"] for m in result.model_state_bytes])
    lines += _per_worker("optimizer state", [m["optimizer"] for m in result.model_state_bytes])
    lines += _per_worker("activations peak", result.activation_peak_bytes)
    lines += _per_worker("comm buffers peak", [_peak(m, "communication") for m in result.memory])
    lines += _per_worker("ledger peak", [m.get("peak_total") for m in result.memory])
    if result.plan is not None:
        from paratrain.run.auto_plan import measured_lines

        peaks = [m.get("peak_total") for m in result.memory]
        lines += measured_lines(result.plan, peaks, result.samples_per_s)
    if result.memory and result.memory[0].get("budget") is not None:
        lines.append(f"  memory budget     {format_bytes(result.memory[0]['budget'])} per worker")
    lines += _strategy_lines(result)
    lines += [f"  checkpoint        {result.checkpoint}", f"  metrics           {result.metrics}"]
    if result.sample_text is not None:
        lines += ["  sample:", *("    " + line for line in result.sample_text.splitlines())]
    return "\n".join(lines)
