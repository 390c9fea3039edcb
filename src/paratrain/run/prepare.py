"""A run prepared once, in the parent, before any worker starts.

``prepare_run`` is the one path every run takes: the planner's choice where the run asked
for ``--strategy auto``, every check (``preflight.py``), the dataset fetched once, the
model built at most once on the meta device (where a check needs it) and shared by the
strategy's checks, the memory budget and the resume, and the run's length. What it
returns (``PreparedRun``) is all ``fit`` needs; the workers rebuild their share from the
config alone.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from paratrain.checkpoints.format import Checkpoint, CheckpointError
from paratrain.checkpoints.locate import find_checkpoint, intact_before
from paratrain.config import AUTO, ConfigError, TrainConfig
from paratrain.data import DatasetBundle
from paratrain.models import build_model, loss_for
from paratrain.run.build import load_data, make_optimizer, meta_model_once, model_options
from paratrain.run.length import RunLength, run_length
from paratrain.run.preflight import (
    check_config,
    check_layout,
    check_model,
    check_names,
    check_pairing,
    refuse_planning_in_job,
)
from paratrain.run.resume import check_resumable, resume_line
from paratrain.run.schedule_notice import schedule_change
from paratrain.runtime.external_job import in_external_job, is_main_process
from paratrain.runtime.launch import default_device_count
from paratrain.runtime.worker_start import start_server_early


@dataclass(frozen=True)
class PreparedRun:
    """A run every check has passed: what ``fit`` launches and reports."""

    config: TrainConfig
    """As given, or as if its flags had named the planner's choice."""
    devices: int
    bundle: DatasetBundle
    length: RunLength
    resume_from: Path | None = None
    resumed: str | None = None
    """What the console says of the resume (``resume_line``); None for a fresh run."""
    plan: Any = None
    """The planner's choice and prediction where the run asked for ``--strategy auto``."""


def prepare_run(config: TrainConfig) -> PreparedRun:
    """Check ``config`` and do the run's one-off work; raises ``ConfigError`` (one
    sentence) for anything that cannot work, before any run folder is made."""
    chosen = None
    if config.strategy == AUTO:
        try:
            config, chosen, bundle = plan_run(config)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        if is_main_process():
            print(f"paratrain: {chosen.summary()}", file=sys.stderr)
        devices = check_layout(config)
    else:
        devices = check_config(config)
        _start_workers_server()
        bundle = load_data(config)
        check_pairing(config, bundle)
    model = meta_model_once(config, bundle)  # built where a check first needs it
    check_model(config, devices, bundle, model)
    length = run_length(config, len(bundle.train))
    resume_from, resumed = _check_resume(config, devices, model, length, len(bundle.train))
    return PreparedRun(config, devices, bundle, length, resume_from, resumed, chosen)


def _start_workers_server() -> None:
    """Where this process will launch the workers (not inside torchrun or Slurm, which
    start the ranks themselves), the server they are forked from starts now, once the
    config's own checks have passed: its import of torch then runs beside the data's
    loading and the model's checks (``worker_start.start_server_early``)."""
    if not in_external_job():
        start_server_early()


def plan_run(
    config: TrainConfig, *, refresh: bool = False
) -> tuple[TrainConfig, Any, DatasetBundle]:
    """``--strategy auto`` and ``paratrain plan``: the planner's choice, made in this process
    before any worker starts (``auto_plan``), the config as if its flags had named it, and
    the dataset it was measured on (``refresh``: measured again, not read from the
    planner's cache). Raises ``NoPlanFits`` where nothing fits (a ``ValueError`` that
    names the smallest)."""
    from paratrain.run.auto_plan import planned_config

    refuse_planning_in_job()
    check_names(config, strategy=False)
    devices = config.devices or default_device_count()
    _start_workers_server()  # the planner measures in launched workers
    bundle = load_data(config)
    check_pairing(config, bundle)
    model = build_model(config.model, **model_options(config, bundle))  # measured: real
    planned, chosen = planned_config(
        config,
        devices=devices,
        model=model,
        optimizer=make_optimizer(config),
        loss_fn=loss_for(config.model),
        sample=bundle.train[: config.global_batch],
        refresh=refresh,
    )
    return planned, chosen, bundle


def _check_resume(
    config: TrainConfig,
    devices: int,
    model: Callable[[], nn.Module],
    length: RunLength,
    train_samples: int,
) -> tuple[Path | None, str | None]:
    """The checkpoint ``--resume`` means, verified here (every checksum) so that a damaged
    file is refused in one sentence before any worker starts or any run folder is made,
    and what the console says of it."""
    if not config.resume:
        return None, None
    resume_from = find_checkpoint(config.resume)
    if not resume_from:
        return resume_from, None
    try:
        checkpoint = Checkpoint(resume_from)
    except CheckpointError as error:
        older = intact_before(Path(config.resume), resume_from)
        if resume_from == Path(config.resume) or older is None:
            raise
        raise CheckpointError(f"{str(error)[:-1]}; resume from {older} instead.") from None
    check_resumable(checkpoint, config, model())
    saved_step = checkpoint.step
    if saved_step >= length.steps:
        more = "--steps" if length.epochs is None else "--epochs"
        raise ConfigError(
            f"{resume_from} is already at step {saved_step} of {length.steps}; "
            f"pass {more} above that to train further."
        )
    line = resume_line(checkpoint, config, devices)
    change = schedule_change(
        checkpoint.metadata.get("config"), saved_step, config, length, train_samples
    )
    return resume_from, line if change is None else f"{line}; {change}"
