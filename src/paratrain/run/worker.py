"""The loop every worker runs: setup, then per step the step and its log, then finish.

Each worker rebuilds the run from the config alone (the parent checked it in
``prepare.py``): the dataset (cached by then), the model, the engine through
``paratrain.setup``. Rank 0 also writes the metrics file; every worker writes its share of
each checkpoint and returns a report the parent gathers (``result.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import paratrain
from paratrain.config import TrainConfig, as_dict
from paratrain.data import GlobalBatchLoader, batches
from paratrain.models import build_model, loss_for
from paratrain.parallel import Engine, StepStats, strategy_class
from paratrain.parallel.metric_tally import Tally
from paratrain.parallel.strategy import RecordsTimeline
from paratrain.reports.metrics_file import MetricsWriter
from paratrain.reports.tensorboard_log import TensorBoardMirror
from paratrain.run.build import load_data, make_optimizer, model_options, strategy_options
from paratrain.run.console import console_line, epoch_fields, progress_bar
from paratrain.run.elastic import (
    Change,
    ElasticWorker,
    admissions,
    attempt_step,
    engine_state,
    hold_for_admission,
    regroup,
    seconds_since,
    stop_short,
    take_furthest_state,
)
from paratrain.run.elastic_copies import keeps_copies, offer, take_offers
from paratrain.run.evaluation import EvalResult, evaluate, running_accuracy
from paratrain.run.faults import arm_faults, inject_fault, launch_rank
from paratrain.run.length import RunLength, eval_batches, evaluates_at, run_length
from paratrain.run.lr_schedule import lr_factor, set_learning_rate
from paratrain.run.metrics import ClassificationSums, TokenSums, metric_for
from paratrain.run.resume import checkpoint_metadata, prune
from paratrain.runtime import comm
from paratrain.runtime.device_oom import device_errors_told
from paratrain.runtime.devices import peak_memory_bytes
from paratrain.runtime.elastic import joining
from paratrain.runtime.signals import TerminationNotice

_TIMELINE_STEPS = 200  # the timeline file keeps the last this-many steps


@dataclass
class WorkerRun:
    """One worker's run: what setup made, and what the steps have measured so far."""

    config: TrainConfig
    run_dir: str
    engine: Engine
    length: RunLength
    metric: ClassificationSums | TokenSums
    train_loader: GlobalBatchLoader
    eval_loader: GlobalBatchLoader
    eval_count: int | None
    """Batches per evaluation; None: the whole split, which may be short."""
    first: int
    """The first step this worker takes (after a resumed checkpoint's)."""
    metrics: MetricsWriter | None
    """The metrics file, on rank 0 only."""
    bar: Any
    scheduled: bool
    """Whether the learning rate follows a schedule (and there is an optimizer to set)."""
    train_tally: Tally
    timed_from: float
    bundle: Any
    """The dataset bundle, kept to rebuild the engine over a new group (elastic)."""
    data_before: dict[str, Any]
    """The train loader's state before the current step's batch (what a checkpoint of the
    step before it records)."""
    started: float = 0.0
    """``time.monotonic()`` when the metrics file was opened (on every worker: a worker
    that takes it over stamps on from there)."""
    elastic: ElasticWorker | None = None
    timed_samples: int = 0
    samples_per_s: float = 0.0
    stats: StepStats | None = None
    evaluation: EvalResult | None = None

    @property
    def lead(self) -> bool:
        return comm.rank() == 0


def train_worker(
    config: TrainConfig, run_dir: str, resume_from: str | None = None, attempt: int = 0
) -> dict[str, Any]:
    """The loop every worker runs; rank 0 also writes metrics; all write checkpoints."""
    run = setup(config, run_dir, resume_from, attempt)
    # SIGTERM: finish this step, checkpoint, return. Open until the report is made: the
    # launcher's forwarded copy of the signal may land while the checkpoint is written.
    notice = TerminationNotice()
    preempted_at = None
    remaining = run.length.steps - run.first + 1
    for step, (inputs, targets) in enumerate(batches(run.train_loader, remaining), run.first):
        inject_fault(step, attempt, hold=lambda: hold_for_admission(run.elastic, 120.0))
        if run.elastic is None:
            stop = _step(run, step, inputs, targets, notice)
        else:
            stop = _elastic_step(run, step, inputs, targets, notice, attempt)
        run.data_before = run.train_loader.state_dict()
        if stop:
            preempted_at = step
            break
    try:
        return finish(run, preempted_at, restarts=attempt)
    finally:
        notice.close()


def _step(run: WorkerRun, step: int, inputs: Any, targets: Any, notice: Any) -> bool:
    """The step, its log, and whether the workers agreed to stop after it (SIGTERM)."""
    take_step(run, step, inputs, targets)
    log_step(run, step)
    engine = run.engine
    return step < run.length.steps and notice.agreed(
        independent=engine.independent_workers, device=engine.device
    )


def _elastic_step(
    run: WorkerRun, step: int, inputs: Any, targets: Any, notice: Any, attempt: int
) -> bool:
    """``_step``, again over the survivors each time a peer dies in it, until some worker
    has completed it; then, at the boundary, any replacement that is ready joins (see
    ``run/elastic``)."""
    clock = [time.perf_counter()]

    def body() -> tuple[bool, Any]:
        stop = _step(run, step, inputs, targets, notice)
        clock[0] = time.perf_counter()
        last = step == run.length.steps or stop  # nothing left for a newcomer to do
        return stop, None if last else admissions(run.elastic)

    while True:
        done, value = attempt_step(body, run.elastic)
        if done:
            stop, post = value
            if post is not None:
                _regroup(run, post, step, clock[0], attempt)
            return stop
        _regroup(run, value, step, clock[0], attempt)
        if run.engine.steps_taken >= step:  # a survivor had finished it: nothing to redo
            return False
        clock[0] = time.perf_counter()


def _carried(run: WorkerRun, step: int) -> dict[str, Any]:
    """What a member's state carries besides the engine's: where the loaders stand after
    the steps it has taken (before this step's batch where it has not finished it), and
    the run's start (a newcomer that becomes the lead stamps records from there)."""
    finished = run.engine.steps_taken >= step
    data = run.train_loader.state_dict() if finished else run.data_before
    return {"data": data, "eval_data": run.eval_loader.state_dict(), "started": run.started}


def _regroup(run: WorkerRun, post: Any, step: int, started: float, attempt: int) -> None:
    """Go on over ``post.members``: the old engine dropped (its group with it), a new group
    and engine, the furthest member's state, the record; below the minimum, save and stop."""
    old = run.elastic.generation.members
    copies = keeps_copies(run.engine)
    own = offer(run.engine) if copies else engine_state(run.engine, _carried(run, step))
    run.train_tally.close()
    run.engine = run.train_tally = None  # the last references to the old group
    generation = regroup(run.elastic, post)
    run.engine = build_engine(run.config, run.bundle)
    arm_faults(run.engine, attempt)
    if copies:  # the survivors' loaders stand alike: only the engine's state is put together
        steps = take_offers(run.engine, own, generation.members)
    else:
        steps = take_furthest_state(run.engine, own)["steps"]
    run.train_tally = run.engine.tally(run.metric)
    lost = tuple(sorted(set(old) - set(generation.members)))
    joined = tuple(sorted(set(generation.members) - set(old)))
    redone = int(steps < step)
    change = Change(
        step, len(old), len(generation.members), lost, seconds_since(started), redone, joined
    )
    if run.lead and run.metrics is None:  # rank 0 died: its successor writes the records
        run.metrics = _metrics_writer(run.config, run.run_dir, run.started)
    if run.lead:
        console_line(change.line(), run.bar)
        run.metrics.write("workers", **change.record())
    if generation.short:
        data = run.data_before if steps < step else run.train_loader.state_dict()
        metadata = {**checkpoint_metadata(run.config, run.train_loader, run.eval_loader)}
        saved = run.engine.save_checkpoint(
            Path(run.run_dir) / "checkpoints" / f"step-{steps:08d}",
            metadata={**metadata, "data": data},
        )
        if run.metrics:
            run.metrics.close()
        stop_short(change, run.elastic.min_devices, Path(saved), steps)


def _metrics_writer(config: TrainConfig, run_dir: str, started: float) -> MetricsWriter:
    mirror = TensorBoardMirror(run_dir) if config.tensorboard else None
    return MetricsWriter(Path(run_dir) / "metrics.jsonl", mirror=mirror, start=started)


def build_engine(config: TrainConfig, bundle: Any) -> Engine:
    """The model and the engine over the current process group."""
    torch.manual_seed(config.seed)
    model = build_model(config.model, **model_options(config, bundle))
    options = strategy_options(config, bundle)
    return paratrain.setup(
        model,
        optimizer=make_optimizer(config),
        loss_fn=loss_for(config.model),
        strategy=config.strategy,
        gradient_accumulation=config.gradient_accumulation,
        **options,
    )


def setup(
    config: TrainConfig, run_dir: str, resume_from: str | None, attempt: int = 0
) -> WorkerRun:
    """The engine, the loaders, the resumed state, the metrics file and the bar."""
    elastic = None
    described = strategy_class(config.strategy)
    in_memory = config.elastic and described.elastic_in_memory(config.strategy_options())
    if in_memory and not joining():  # marked before any step: a death is survived
        elastic = ElasticWorker.join(
            launch_rank(), config.min_devices, config.max_restarts, config.timeout
        )
    bundle = load_data(config)
    if in_memory and joining():  # a replacement: ready once its data is loaded
        elastic = ElasticWorker.replace(launch_rank(), config.min_devices, config.timeout)
    engine = build_engine(config, bundle)
    arm_faults(engine, attempt)
    carried = take_furthest_state(engine, None) if elastic and elastic.late else None
    lead = comm.rank() == 0
    length = run_length(config, len(bundle.train))
    metric = metric_for(bundle.kind)
    train_loader = GlobalBatchLoader(bundle.train, config.global_batch, seed=config.seed)
    eval_count = eval_batches(config, length)  # None: the whole split, which may be short
    tail = "wrap" if eval_count is None else "drop"
    eval_loader = GlobalBatchLoader(bundle.val, config.global_batch, shuffle=False, tail=tail)
    first = 1
    if carried is not None:  # a replacement starts where the group stands
        train_loader.load_state_dict(carried["data"])
        eval_loader.load_state_dict(carried["eval_data"])
        first = carried["steps"] + 1
    elif resume_from:
        checkpoint = engine.load_checkpoint(resume_from)
        if "data" in checkpoint.metadata:  # an imported checkpoint starts the data afresh
            train_loader.load_state_dict(checkpoint.metadata["data"])
        saved_eval = checkpoint.metadata.get("eval_data")
        # The eval loader's place: another --eval-batches (another tail) evaluates other
        # batches anyway, so there the loader starts afresh, as the user asked for.
        if saved_eval and saved_eval.get("tail") == eval_loader.tail:
            eval_loader.load_state_dict(saved_eval)
        first = engine.steps_taken + 1
    metrics = None
    started = carried["started"] if carried else time.monotonic()
    if lead and carried is None:
        metrics = _metrics_writer(config, run_dir, started)
        metrics.write(
            "config",
            workers=comm.world_size(),
            config=as_dict(config),
            resumed_from=resume_from,
            start_step=first - 1,
            attempt=attempt,
        )
    bar = progress_bar(config, length, enabled=lead, initial=first - 1)
    # A stage without parameters (pipeline) holds no optimizer and nothing to schedule.
    scheduled = engine.optimizer is not None and (
        config.lr_schedule != "constant" or config.warmup_steps > 0
    )
    return WorkerRun(
        config=config,
        run_dir=run_dir,
        engine=engine,
        length=length,
        metric=metric,
        train_loader=train_loader,
        eval_loader=eval_loader,
        eval_count=eval_count,
        first=first,
        metrics=metrics,
        bar=bar,
        scheduled=scheduled,
        train_tally=engine.tally(metric),  # every training prediction, until closed
        timed_from=time.perf_counter(),
        bundle=bundle,
        data_before=train_loader.state_dict(),
        started=started,
        elastic=elastic,
    )


def take_step(run: WorkerRun, step: int, inputs: Any, targets: Any) -> None:
    """The learning rate for this step, the step, a periodic checkpoint, and the timing
    (from the second step on: the first pays one-off costs, allocation and warm-up)."""
    config, engine = run.config, run.engine
    if run.scheduled:
        factor = lr_factor(
            config.lr_schedule,
            step,
            total_steps=run.length.steps,
            warmup_steps=config.warmup_steps,
        )
        set_learning_rate(engine.optimizer, config.lr * factor)
    with device_errors_told(engine.memory.ledger):
        run.stats = engine.train_step(inputs, targets)
    periodic = config.checkpoint_every and step % config.checkpoint_every == 0
    if periodic and step < run.length.steps:
        engine.save_checkpoint(
            Path(run.run_dir) / "checkpoints" / f"step-{step:08d}",
            metadata=checkpoint_metadata(config, run.train_loader, run.eval_loader),
        )
        if run.lead:
            prune(Path(run.run_dir), config.keep_checkpoints)
    if step == run.first:
        run.timed_from, run.timed_samples = time.perf_counter(), 0
    else:
        run.timed_samples += run.stats.samples
    elapsed = time.perf_counter() - run.timed_from
    run.samples_per_s = run.timed_samples / elapsed if run.timed_samples else 0.0


def log_step(run: WorkerRun, step: int) -> None:
    """An evaluation where one is due, the train record every ``--log-every`` steps, and
    the progress bar."""
    config, engine, length, stats = run.config, run.engine, run.length, run.stats
    if evaluates_at(config, length, step):
        run.evaluation = evaluate(engine, run.metric, run.eval_loader, run.eval_count)
        if run.metrics:
            run.metrics.write(
                "eval", step=step, **epoch_fields(length, step), **run.evaluation.record()
            )
        if run.lead:
            console_line(run.evaluation.line(length.where(step)), run.bar)
    logs = step % config.log_every == 0 or step == length.steps
    if logs:  # every worker: a collective where the workers split the batch
        accuracy = running_accuracy(engine, run.train_tally)
    if run.metrics and logs:
        run.metrics.write(
            "train",
            step=step,
            **epoch_fields(length, step),
            loss=stats.loss,
            **({"accuracy": accuracy} if accuracy is not None else {}),
            samples_per_s=run.samples_per_s,
            comm_bytes=stats.comm_bytes,
            skipped_steps=stats.skipped_steps,
            **({"loss_scale": stats.loss_scale} if config.precision == "fp16" else {}),
            **(
                {"lr": engine.optimizer.param_groups[0]["lr"]}
                if engine.optimizer is not None
                else {}
            ),
            **({"grad_norm": stats.grad_norm} if stats.grad_norm is not None else {}),
        )
    if run.bar is not None:
        # The postfix waits for the bar's own throttled redraw: refreshing it here would
        # write a line per step into a log file (mininterval governs update() only).
        run.bar.set_postfix(
            **epoch_fields(length, step, text=True),
            loss=f"{stats.loss:.4f}",
            samples_s=f"{run.samples_per_s:.0f}",
            refresh=False,
        )
        run.bar.update(1)


def finish(run: WorkerRun, preempted_at: int | None, restarts: int = 0) -> dict[str, Any]:
    """Close what the loop opened, save the final checkpoint (or, stopped by SIGTERM, one
    where ``--resume`` finds it as the newest), write the memory records and the summary,
    and return this worker's report (``restarts``: relaunches after a failed worker that
    this run took to finish, said in its summary)."""
    engine, run_dir = run.engine, run.run_dir
    run.train_tally.close()
    if run.bar is not None:
        run.bar.close()
    if isinstance(engine, RecordsTimeline):
        engine.write_timeline(run_dir, last_steps=_TIMELINE_STEPS)
    engine.finish_training()
    if preempted_at is None:
        checkpoint = Path(run_dir) / "final"
    else:  # where a periodic checkpoint goes, so --resume finds it as the newest
        checkpoint = Path(run_dir) / "checkpoints" / f"step-{preempted_at:08d}"
    checkpoint = engine.save_checkpoint(
        checkpoint, metadata=checkpoint_metadata(run.config, run.train_loader, run.eval_loader)
    )
    if preempted_at is not None and checkpoint.name.startswith("step-"):
        # ps: the folder the first worker to save wrote, at its own step (it may also be
        # "final", where that worker had finished the run when the signal came)
        preempted_at = int(checkpoint.name.removeprefix("step-"))
    write_memory(engine, run.metrics)
    total = time.perf_counter() - run.timed_from
    report = {**_report(run, checkpoint, preempted_at, total), "restarts": restarts}
    if run.metrics:
        if not engine.independent_workers:  # else the parent writes the run's summary
            skip = ("rank", "memory")  # memory has its own records, one per worker
            run.metrics.write("summary", **{k: v for k, v in report.items() if k not in skip})
        run.metrics.close()
    engine.close()
    return report


def _report(
    run: WorkerRun, checkpoint: Path, preempted_at: int | None, total: float
) -> dict[str, Any]:
    """This worker's figures, as the parent gathers them into a ``RunResult``."""
    engine, stats, evaluation = run.engine, run.stats, run.evaluation
    strategy_metrics = engine.run_metrics()
    return {
        "rank": comm.rank(),
        "final_train_loss": stats.loss,
        "final_eval_loss": evaluation.loss if evaluation else None,
        "final_accuracy": evaluation.accuracy if evaluation else None,
        "samples_per_s": run.timed_samples / total if run.timed_samples else 0.0,
        "peak_memory_bytes": peak_memory_bytes(engine.device),
        "parameter_bytes": engine.parameter_bytes,
        "model_state_bytes": engine.model_state_bytes(),
        "activation_peak_bytes": engine.memory.activation_peak_bytes(),
        "memory": engine.memory.ledger.record(),
        "skipped_steps": stats.skipped_steps,
        "loss_scale": stats.loss_scale,
        "checkpoint": str(checkpoint),
        "preempted_at": preempted_at,
        "metrics": str(Path(run.run_dir) / "metrics.jsonl"),
        **({engine.name: strategy_metrics} if strategy_metrics is not None else {}),
    }


def write_memory(engine: Engine, metrics: MetricsWriter | None) -> list[dict[str, Any]]:
    """Gather every worker's memory ledger to rank 0, which writes one record per worker."""
    own = engine.memory.ledger.record()
    gathered = [own]
    # Independent workers (ps) never wait on one another (a lost worker would hang it):
    # the parent writes their records from every worker's report (``_write_independent``).
    if engine.independent_workers:
        return gathered
    if comm.distributed():
        gathered = [None] * comm.world_size() if comm.rank() == 0 else None
        dist.gather_object(own, gathered, dst=0)
    if metrics:
        for record in gathered:
            metrics.write("memory", **record)
    return gathered or []
