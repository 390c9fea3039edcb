"""``fit(config)``: a whole training run, from validated config to printed summary.

The parent process checks everything it can before any worker starts (names, the model
and dataset pairing, batch divisibility, the dataset being present), fetches the dataset
once, then launches the workers. Each worker runs the same loop against the Engine
interface; rank 0 writes the metrics file and the checkpoint. The parent prints the
summary, including a text sample generated from the saved checkpoint for ``gpt``.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import paratrain
from paratrain.checkpoints.format import Checkpoint
from paratrain.config import AUTO, ConfigError, TrainConfig, as_dict
from paratrain.data import (
    ChecksumError,
    DatasetBundle,
    DatasetUnavailable,
    GlobalBatchLoader,
    batches,
    build_dataset,
)
from paratrain.run.evaluation import evaluate, running_accuracy
from paratrain.run.lr_schedule import lr_factor, set_learning_rate
from paratrain.run.metrics import metric_for
from paratrain.models import MODEL_NAMES, build_model, loss_for
from paratrain.parallel import RunSpec, strategy_class, strategy_names
from paratrain.parallel.fit_advice import advice
from paratrain.parallel.strategy import RecordsTimeline
from paratrain.run.preflight import (
    check_backend,
    check_data_dir,
    check_dataset,
    time_sharing_warning,
)
from paratrain.reports.metrics_file import MetricsWriter, append_records, format_bytes
from paratrain.run.resume import (
    check_resumable,
    checkpoint_metadata,
    inject_fault,
    launch_with_restarts,
    prune,
    resume_line,
    run_dir_of,
    settle_failed_run,
)
from paratrain.checkpoints.locate import find_checkpoint
from paratrain.run.length import RunLength, eval_batches, evaluates_at, run_length
from paratrain.runtime import comm
from paratrain.runtime.devices import peak_memory_bytes
from paratrain.runtime.external_job import check_job_devices, is_main_process
from paratrain.runtime.launch import LostWorker, default_device_count, in_external_job
from paratrain.runtime.signals import TerminationNotice
from paratrain.runtime.units import parse_size
from paratrain.reports.tensorboard_log import TensorBoardMirror, check_tensorboard

_TOKEN_MODELS = ("gpt",)
_IMAGE_MODELS = ("lenet",)
_TIMELINE_STEPS = 200  # the timeline file keeps the last this-many steps


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
    resumed: str | None = None
    """Where a resumed run came from (``resume_line``); None for a fresh run."""
    extra: dict[str, Any] = field(default_factory=dict)
    plan: Any = None
    """The planner's choice and prediction where the run asked for ``--strategy auto``."""


def validate(config: TrainConfig, bundle: DatasetBundle | None = None) -> int:
    """Refuse what cannot work before any worker starts; returns the device count.

    Every strategy is asked the same question (``Engine.check_run``); with the dataset's
    ``bundle`` the strategy may also check the model (on the meta device, no weights).
    """
    if config.model not in MODEL_NAMES:
        raise ConfigError(
            f"unknown model {config.model!r}; choose one of {', '.join(MODEL_NAMES)}."
        )
    check_dataset(config)
    if config.strategy not in strategy_names():
        raise ConfigError(
            f"unknown strategy {config.strategy!r}; choose one of {', '.join(strategy_names())}."
        )
    check_data_dir(config)
    check_tensorboard(config)
    devices = config.devices or default_device_count()
    check_backend(config, devices)
    try:
        if in_external_job():
            check_job_devices(config.devices)
        strategy_class(config.strategy).check_run(run_spec(config, devices, bundle))
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return devices


def run_spec(config: TrainConfig, devices: int, bundle: DatasetBundle | None = None) -> RunSpec:
    """The run as the strategy sees it before any worker starts."""

    def build_meta_model():
        with torch.device("meta"):
            return build_model(config.model, **model_options(config, bundle))

    return RunSpec(
        devices=devices,
        global_batch=config.global_batch,
        gradient_accumulation=config.gradient_accumulation,
        options=config.strategy_options(),
        external_job=in_external_job(),
        timeout_s=config.timeout,
        max_grad_norm=config.max_grad_norm,
        build_model=build_meta_model if bundle is not None else None,
        sample_inputs=(lambda n: bundle.train[:n][0]) if bundle is not None else None,
    )


def check_memory(config: TrainConfig, bundle: DatasetBundle, devices: int) -> None:
    """Refuse a budget that the parameters alone exceed, counted on a meta-device model.

    Only what is certain before training is checked (parameters, at the share the strategy
    gives each worker at best); gradients, optimizer state and activations are checked by
    each worker's ledger from the first step on.
    """
    budget = parse_size(config.memory_per_device)
    if budget is None:
        return
    with torch.device("meta"):
        model = build_model(config.model, **model_options(config, bundle))
    parameters = list(dict.fromkeys(model.parameters()))
    share = strategy_class(config.strategy).parameter_share(devices, config.strategy_options())
    if share is None:
        return
    held = sum(p.numel() * p.element_size() for p in parameters) * share
    if held > budget:
        raise ConfigError(
            f"the parameters alone need {format_bytes(held)} per worker under strategy "
            f"{config.strategy!r}, over --memory-per-device {format_bytes(budget)}; "
            + advice(
                parameters=sum(p.numel() for p in parameters),
                workers=devices,
                budget=budget,
                candidates=strategy_names(),
                current=config.strategy,
            )
            + "."
        )


def check_pairing(config: TrainConfig, bundle: DatasetBundle) -> None:
    """A token model needs a token dataset, an image model an image dataset."""
    wants_tokens = config.model in _TOKEN_MODELS
    if wants_tokens != (bundle.kind == "tokens"):
        need = (
            "a token dataset (shakespeare, synthetic_tokens)"
            if wants_tokens
            else ("a classification dataset (fashion_mnist, synthetic, synthetic_images)")
        )
        raise ConfigError(f"model {config.model!r} needs {need}, not {config.dataset!r}.")
    if config.model in _IMAGE_MODELS and len(bundle.input_shape) != 3:
        raise ConfigError(
            f"model {config.model!r} needs image-shaped inputs (C, H, W), but {config.dataset!r} "
            f"gives {tuple(bundle.input_shape)}; use fashion_mnist or synthetic_images."
        )
    if len(bundle.train) < config.global_batch:
        raise ConfigError(
            f"dataset {config.dataset!r} has {len(bundle.train)} training samples, fewer than "
            f"one global batch of {config.global_batch}; lower --global-batch."
        )


def load_data(config: TrainConfig) -> DatasetBundle:
    """The run's dataset (downloaded and cached on first use); a dataset neither on disk
    nor downloadable, or a download or cached copy that fails its checksum, is refused with
    the data layer's sentence, which says what to do."""
    try:
        return build_dataset(
            config.dataset, data_dir=config.data_dir, block_size=config.block_size, seed=config.seed
        )
    except (DatasetUnavailable, ChecksumError) as error:
        raise ConfigError(str(error)) from None


def model_options(config: TrainConfig, bundle: DatasetBundle) -> dict[str, Any]:
    """The model's constructor options, sized from the config and the dataset."""
    if config.model == "gpt":
        return {
            "vocab_size": bundle.vocab_size,
            "block_size": config.block_size,
            "n_layer": config.n_layer,
            "n_head": config.n_head,
            "n_embd": config.n_embd,
            "tie_embeddings": config.tie_embeddings,
        }
    classes = bundle.num_classes
    if config.model == "mlp":
        return {
            "in_features": math.prod(bundle.input_shape),
            "hidden": config.hidden,
            "depth": config.depth,
            "classes": classes,
        }
    return {"classes": classes, "in_channels": bundle.input_shape[0]}


def make_optimizer(config: TrainConfig):
    """The optimizer factory the engine calls with the parameters it owns."""
    name, lr, decay = config.optimizer, config.lr, config.weight_decay
    if name == "sgd":
        return lambda params: torch.optim.SGD(
            params, lr=lr, momentum=config.momentum, weight_decay=decay
        )
    if name == "adam":
        return lambda params: torch.optim.Adam(params, lr=lr, weight_decay=decay)
    return lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=decay)


def default_run_dir(config: TrainConfig) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{config.model}-{config.strategy}-{stamp}"


def plan_run(config: TrainConfig) -> tuple[TrainConfig, Any]:
    """``--strategy auto`` and ``paratrain plan``: the planner's choice, made in this process
    before any worker starts (``auto_plan``), and the config as if its flags had named it.
    Raises ``NoPlanFits`` where nothing fits (a ``ValueError`` that names the smallest)."""
    from paratrain.run.auto_plan import planned_config

    if in_external_job():
        raise ConfigError(
            "--strategy auto plans before the workers start, which torchrun does not let it "
            "do; run `paratrain plan` with the same flags and pass the strategy it prints."
        )
    if config.model not in MODEL_NAMES:
        raise ConfigError(
            f"unknown model {config.model!r}; choose one of {', '.join(MODEL_NAMES)}."
        )
    check_dataset(config)
    check_data_dir(config)
    check_tensorboard(config)
    devices = config.devices or default_device_count()
    bundle = load_data(config)
    check_pairing(config, bundle)
    model = build_model(config.model, **model_options(config, bundle))
    return planned_config(
        config,
        devices=devices,
        model=model,
        optimizer=make_optimizer(config),
        loss_fn=loss_for(config.model),
        sample=bundle.train[: config.global_batch],
    )


def fit(config: TrainConfig) -> RunResult:
    """Train as ``config`` says on local workers (or inside torchrun) and return the summary."""
    chosen = None
    if config.strategy == AUTO:
        try:
            config, chosen = plan_run(config)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        if is_main_process():
            print(f"paratrain: {chosen.summary()}", file=sys.stderr)
    devices = validate(config)
    bundle = load_data(config)
    check_pairing(config, bundle)
    validate(config, bundle)
    check_memory(config, bundle, devices)
    length = run_length(config, len(bundle.train))
    resume_from = find_checkpoint(config.resume) if config.resume else None
    resumed = None
    if resume_from:
        # verified here (every checksum), so a damaged file is refused in one sentence
        # before any worker starts or any run folder is made
        checkpoint = Checkpoint(resume_from)
        check_resumable(checkpoint, config, run_spec(config, devices, bundle).build_model())
        resumed = resume_line(checkpoint, config, devices)
        saved_step = checkpoint.step
        if saved_step >= length.steps:
            more = "--steps" if length.epochs is None else "--epochs"
            raise ConfigError(
                f"{resume_from} is already at step {saved_step} of {length.steps}; "
                f"pass {more} above that to train further."
            )
    run_dir = Path(config.run_dir) if config.run_dir else None
    if run_dir is None:
        run_dir = (run_dir_of(resume_from) if resume_from else None) or default_run_dir(config)
    # Said once every check has passed: a refused run's output is its one sentence.
    warning = time_sharing_warning(config, devices)
    if warning and is_main_process():
        print(warning, file=sys.stderr)
    created = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    if resumed and is_main_process():
        print(f"paratrain: resuming {resumed}", file=sys.stderr)
    try:
        reports = launch_with_restarts(train_worker, config, devices, run_dir, resume_from)
    except BaseException as error:
        settle_failed_run(run_dir, error, created=created)
        raise
    # Inside torchrun, ranks other than 0 get their own report only (see external_job).
    reports = [r for r in reports if r is not None]
    lost = {r.rank: r.reason for r in reports if isinstance(r, LostWorker)}
    lead = next(r for r in reports if not isinstance(r, LostWorker))
    reports = [_lost_report(lead) if isinstance(r, LostWorker) else r for r in reports]
    result = RunResult(
        config=config,
        devices=devices,
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
        steps=length.steps,
        final_accuracy=lead["final_accuracy"],
        preempted_at=lead["preempted_at"],
        resumed=resumed,
        plan=chosen,
    )
    if strategy_class(config.strategy).independent_workers:
        _independent_result(result, [r for r in reports if r["rank"] is not None], lost)
    if config.strategy in lead:  # what the engine's run_metrics() returned
        result.extra[config.strategy] = lead[config.strategy]
    if strategy_class(config.strategy).independent_workers:
        _write_independent(result, lead, reports, lost)
    if (
        config.model == "gpt"
        and config.sample_chars
        and is_main_process()
        and result.preempted_at is None
    ):
        from paratrain.run.sampling import sample_text

        result.sample_text = sample_text(
            config, bundle, result.checkpoint, model_options(config, bundle)
        )
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


def strategy_options(config: TrainConfig, bundle: DatasetBundle | None) -> dict[str, Any]:
    """The engine's keywords from the config: the strategy's own options, what the run adds
    to them (``Engine.launch_options``), and the shared ones.

    The shared options every engine takes (precision, memory_per_device) are passed only
    when they differ from the engines' defaults, which keeps a user's custom engine that
    predates them working.
    """
    options = config.strategy_options()
    devices = comm.world_size() if comm.distributed() else (config.devices or 1)
    options.update(
        strategy_class(config.strategy).launch_options(run_spec(config, devices, bundle))
    )
    if config.precision != "fp32":
        options["precision"] = config.precision
    if config.memory_per_device is not None:
        options["memory_per_device"] = config.memory_per_device
    if config.max_grad_norm is not None:
        options["max_grad_norm"] = config.max_grad_norm
    return options


def write_memory(engine, metrics: MetricsWriter | None) -> list[dict[str, Any]]:
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


def train_worker(
    config: TrainConfig, run_dir: str, resume_from: str | None = None, attempt: int = 0
) -> dict[str, Any]:
    """The loop every worker runs; rank 0 also writes metrics; all write checkpoints."""
    torch.manual_seed(config.seed)
    bundle = load_data(config)
    model = build_model(config.model, **model_options(config, bundle))
    options = strategy_options(config, bundle)
    engine = paratrain.setup(
        model,
        optimizer=make_optimizer(config),
        loss_fn=loss_for(config.model),
        strategy=config.strategy,
        gradient_accumulation=config.gradient_accumulation,
        **options,
    )
    lead = comm.rank() == 0
    length = run_length(config, len(bundle.train))
    metric = metric_for(bundle.kind)
    train_loader = GlobalBatchLoader(bundle.train, config.global_batch, seed=config.seed)
    eval_count = eval_batches(config, length)  # None: the whole split, which may be short
    tail = "wrap" if eval_count is None else "drop"
    eval_loader = GlobalBatchLoader(bundle.val, config.global_batch, shuffle=False, tail=tail)
    first = 1
    if resume_from:
        checkpoint = engine.load_checkpoint(resume_from)
        if "data" in checkpoint.metadata:  # an imported checkpoint starts the data afresh
            train_loader.load_state_dict(checkpoint.metadata["data"])
        first = engine.steps_taken + 1
    metrics = None
    if lead:
        mirror = TensorBoardMirror(run_dir) if config.tensorboard else None
        metrics = MetricsWriter(Path(run_dir) / "metrics.jsonl", mirror=mirror)
    if metrics:
        metrics.write(
            "config", workers=comm.world_size(), config=as_dict(config), resumed_from=resume_from
        )
    bar = _progress_bar(config, length, enabled=lead, initial=first - 1)
    evaluation = None
    start = time.perf_counter()
    timed_from, timed_samples = start, 0
    stats = None
    remaining = length.steps - first + 1
    # A stage without parameters (pipeline) holds no optimizer and nothing to schedule.
    scheduled = engine.optimizer is not None and (
        config.lr_schedule != "constant" or config.warmup_steps > 0
    )
    train_tally = engine.tally(metric)  # every training prediction, until closed
    notice = TerminationNotice()  # SIGTERM: finish this step, checkpoint, return
    preempted_at = None
    for step, (inputs, targets) in enumerate(batches(train_loader, remaining), start=first):
        inject_fault(step, attempt)
        if scheduled:
            factor = lr_factor(
                config.lr_schedule,
                step,
                total_steps=length.steps,
                warmup_steps=config.warmup_steps,
            )
            set_learning_rate(engine.optimizer, config.lr * factor)
        stats = engine.train_step(inputs, targets)
        periodic = config.checkpoint_every and step % config.checkpoint_every == 0
        if periodic and step < length.steps:
            engine.save_checkpoint(
                Path(run_dir) / "checkpoints" / f"step-{step:08d}",
                metadata=checkpoint_metadata(config, train_loader),
            )
            if lead:
                prune(Path(run_dir), config.keep_checkpoints)
        if step == first:  # the first step pays one-off costs (allocation, warm-up)
            timed_from, timed_samples = time.perf_counter(), 0
        else:
            timed_samples += stats.samples
        elapsed = time.perf_counter() - timed_from
        samples_per_s = timed_samples / elapsed if timed_samples else 0.0
        if evaluates_at(config, length, step):
            evaluation = evaluate(engine, metric, eval_loader, eval_count)
            if metrics:
                metrics.write("eval", step=step, **_epoch(length, step), **evaluation.record())
            if lead:
                _console(evaluation.line(length.where(step)), bar)
        logs = step % config.log_every == 0 or step == length.steps
        if logs:  # every worker: a collective where the workers split the batch
            accuracy = running_accuracy(engine, train_tally)
        if metrics and logs:
            metrics.write(
                "train",
                step=step,
                **_epoch(length, step),
                loss=stats.loss,
                **({"accuracy": accuracy} if accuracy is not None else {}),
                samples_per_s=samples_per_s,
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
        if bar is not None:
            # The postfix waits for the bar's own throttled redraw: refreshing it here would
            # write a line per step into a log file (mininterval governs update() only).
            bar.set_postfix(
                **_epoch(length, step, text=True),
                loss=f"{stats.loss:.4f}",
                samples_s=f"{samples_per_s:.0f}",
                refresh=False,
            )
            bar.update(1)
        if step < length.steps and notice.agreed(
            independent=engine.independent_workers, device=engine.device
        ):
            preempted_at = step
            break
    notice.close()
    train_tally.close()
    if bar is not None:
        bar.close()
    if isinstance(engine, RecordsTimeline):
        engine.write_timeline(run_dir, last_steps=_TIMELINE_STEPS)
    engine.finish_training()
    if preempted_at is None:
        checkpoint = Path(run_dir) / "final"
    else:  # where a periodic checkpoint goes, so --resume finds it as the newest
        checkpoint = Path(run_dir) / "checkpoints" / f"step-{preempted_at:08d}"
    engine.save_checkpoint(checkpoint, metadata=checkpoint_metadata(config, train_loader))
    write_memory(engine, metrics)
    total = time.perf_counter() - timed_from
    strategy_metrics = engine.run_metrics()
    report = {
        "rank": comm.rank(),
        "final_train_loss": stats.loss,
        "final_eval_loss": evaluation.loss if evaluation else None,
        "final_accuracy": evaluation.accuracy if evaluation else None,
        "samples_per_s": timed_samples / total if timed_samples else 0.0,
        "peak_memory_bytes": peak_memory_bytes(engine.device),
        "parameter_bytes": engine.parameter_bytes,
        "model_state_bytes": engine.model_state_bytes(),
        "activation_peak_bytes": engine.memory.activation_peak_bytes(),
        "memory": engine.memory.ledger.record(),
        "skipped_steps": stats.skipped_steps,
        "loss_scale": stats.loss_scale,
        "checkpoint": str(checkpoint),
        "preempted_at": preempted_at,
        "metrics": str(Path(run_dir) / "metrics.jsonl"),
        **({engine.name: strategy_metrics} if strategy_metrics is not None else {}),
    }
    if metrics:
        if not engine.independent_workers:  # else the parent writes the run's summary
            skip = ("rank", "memory")  # memory has its own records, one per worker
            metrics.write("summary", **{k: v for k, v in report.items() if k not in skip})
        metrics.close()
    engine.close()
    return report


def _epoch(length: RunLength, step: int, *, text: bool = False) -> dict[str, Any]:
    """``{"epoch": 2}`` (``"2/4"`` as text) in a run by epochs; nothing in one by steps."""
    if length.epochs is None:
        return {}
    epoch = length.epoch_of(step)
    return {"epoch": f"{epoch}/{length.epochs}" if text else epoch}


def _console(line: str, bar) -> None:
    """One line on the console, above the progress bar where there is one."""
    if bar is None:
        print(line, flush=True)
    else:
        bar.write(line)


def _progress_bar(config: TrainConfig, length: RunLength, *, enabled: bool, initial: int = 0):
    if not (enabled and config.progress):
        return None

    from tqdm.auto import tqdm

    # One process draws the only bar, so a thread lock serves; tqdm's default also makes a
    # multiprocessing semaphore, which a worker stopped by Ctrl-C (SIGKILL) leaks, and the
    # resource tracker then prints a two-line warning under the run's one-line ending.
    tqdm.set_lock(threading.RLock())
    # Redrawn in place on a terminal; in a log file, a line every 10 s rather than a flood.
    interval = 0.2 if sys.stderr.isatty() else 10.0
    return tqdm(
        total=length.steps,
        desc=f"train {config.model}/{config.strategy}",
        unit="step",
        initial=initial,
        mininterval=interval,
    )
