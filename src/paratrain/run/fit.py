"""``fit(config)``: a whole training run, from the config to the result the console prints.

The parent prepares the run once (``prepare.py``: every check, the dataset fetched once,
the meta model, the resume, the plan), makes the run folder, launches the workers
(``worker.py``: setup, step, log, finish), and gathers their reports into a ``RunResult``
(``result.py``), with a text sample generated from the saved checkpoint for ``gpt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from paratrain.config import TrainConfig
from paratrain.run.agent_restart import resume_after_agent_restart
from paratrain.run.build import model_options
from paratrain.run.precision_notice import bf16_notice
from paratrain.run.preflight import time_sharing_warning
from paratrain.run.prepare import PreparedRun, prepare_run
from paratrain.run.result import RunResult, collect_result
from paratrain.run.resume import launch_with_restarts, run_dir_of, settle_failed_run
from paratrain.run.run_folder import check_run_dir, default_run_dir, make_run_dir
from paratrain.run.worker import train_worker
from paratrain.runtime.external_job import decided_once, is_main_process, join_job, leave_job
from paratrain.runtime.launch import in_external_job, resolve_backend

__all__ = ["RunResult", "fit"]


def fit(config: TrainConfig) -> RunResult:
    """Train as ``config`` says on local workers (or inside torchrun) and return the summary."""
    config = resume_after_agent_restart(config)  # torchrun --max-restarts: go on from there
    run = prepare_run(config)
    config = run.config  # the planner's choice where the run asked for one
    if in_external_job():  # the group now, so that rank 0 alone decides the folder
        join_job(config.backend, config.timeout, resolve_backend)
    try:
        run_dir, created = decided_once(lambda: _settle_run_dir(run))
    except BaseException:
        leave_job()  # every rank refuses alike; no group left to abort at exit
        raise
    # Said once every check has passed: a refused run's output is its one sentence.
    for warning in (time_sharing_warning(config, run.devices), bf16_notice(config, run.devices)):
        if warning and is_main_process():
            print(warning, file=sys.stderr)
    if run.resumed and is_main_process():
        print(f"paratrain: resuming {run.resumed}", file=sys.stderr)
    try:
        reports = launch_with_restarts(train_worker, config, run.devices, run_dir, run.resume_from)
    except BaseException as error:
        settle_failed_run(run_dir, error, created=created)
        raise
    result = collect_result(run, run_dir, reports)
    if (
        config.model == "gpt"
        and config.sample_chars
        and is_main_process()
        and result.preempted_at is None
    ):
        from paratrain.run.sampling import sample_text

        result.sample_text = sample_text(
            config, run.bundle, result.checkpoint, model_options(config, run.bundle)
        )
    return result


def _settle_run_dir(run: PreparedRun) -> tuple[Path, bool]:
    """The run folder, checked and made (rank 0's decision under torchrun, with its
    clock); returns it and whether this run made it."""
    path = _run_dir(run)
    resumed_in = run_dir_of(run.resume_from) if run.resume_from else None
    check_run_dir(path, resumed_in=resumed_in, overwrite=run.config.overwrite)
    return path, make_run_dir(path, overwrite=run.config.overwrite)


def _run_dir(run: PreparedRun) -> Path:
    """``--run-dir``, else the folder of the run being resumed, else a new dated one."""
    if run.config.run_dir:
        return Path(run.config.run_dir)
    resumed_in = run_dir_of(run.resume_from) if run.resume_from else None
    if resumed_in:
        return resumed_in
    return default_run_dir(run.config)
