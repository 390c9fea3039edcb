"""Surviving interruptions: where to resume from, restarts after a failed worker, pruning.

The checkpoint carries all state across (model, optimizer, RNG, the data loader's
position), so resuming, at any device count, and restarting after a crash are the same
thing: start fresh workers and load the newest complete checkpoint.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import torch

import paratrain
from paratrain.checkpoints.format import Checkpoint
from paratrain.checkpoints.locate import find_checkpoint as find_checkpoint  # its old home
from paratrain.checkpoints.locate import latest_checkpoint
from paratrain.checkpoints.model_state import mismatch
from paratrain.config import ConfigError, TrainConfig, as_dict
from paratrain.data import GlobalBatchLoader
from paratrain.parallel import strategy_class
from paratrain.reports.metrics_file import MetricsWriter, read_metrics
from paratrain.run.elastic_fallback import go_on_from_checkpoint, lost_state
from paratrain.runtime.launch import WorkerError


def check_resumable(checkpoint: Checkpoint, config: TrainConfig, model: torch.nn.Module) -> None:
    """Refuse, before any worker starts, a resume the workers could not carry out: a model
    whose names or shapes differ from the checkpoint's (``model`` may be on the meta
    device). (A length the checkpoint has already reached is refused by ``fit``, which
    knows the length ``--epochs`` means.)"""
    found = {name: checkpoint.shape("model", name) for name in checkpoint.names("model")}
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    problem = mismatch(found, expected, source=f"checkpoint {checkpoint.directory}")
    if problem:
        raise ConfigError(
            problem[:-1] + "; resume with the model settings it was saved with (drop the "
            "model flags where its config was saved with it)."
        )


def resume_line(checkpoint: Checkpoint, config: TrainConfig, devices: int) -> str:
    """What the console says of a resume ("resuming ...", then "resumed ..." in the
    summary): from where, at which step, saved under which layout and now under which."""
    layout = checkpoint.manifest.get("layout", {})
    saved = f"{layout.get('strategy', '?')} on {layout.get('world_size', '?')} worker(s)"
    imported = checkpoint.metadata.get("imported_from")
    origin = f"imported from {imported}, optimizer fresh" if imported else f"saved under {saved}"
    return (
        f"from {checkpoint.directory} at step {checkpoint.step} ({origin}; now "
        f"{config.strategy} on {devices} worker(s))"
    )


def settle_failed_run(run_dir: Path, error: BaseException, *, created: bool) -> None:
    """After a failed launch: remove the run folder this launch made if it holds nothing
    worth keeping (no checkpoint, no logged step), else mark the failure in its metrics
    file, so no folder is left that looks like a run but says nothing."""
    metrics = run_dir / "metrics.jsonl"
    try:
        logged = metrics.exists() and any(
            record.get("kind") in ("train", "eval") for record in read_metrics(metrics)
        )
    except ValueError:  # a line cut short by the failure: something was written, keep it
        logged = True
    if created and not logged and latest_checkpoint(run_dir) is None:
        shutil.rmtree(run_dir, ignore_errors=True)
        return
    try:
        writer = MetricsWriter(metrics)
        writer.write("failed", error=failure_sentence(error))
        writer.close()
    except OSError:  # a full or read-only disk: the run's own error says so, not this one
        pass


def failure_sentence(error: BaseException) -> str:
    """One line for the metrics file: which worker failed and its exception's last line."""
    if isinstance(error, WorkerError):
        lines = [line for line in error.details.strip().splitlines() if line.strip()]
        return f"worker {error.rank} failed: {lines[-1].strip() if lines else 'no details'}"
    if isinstance(error, KeyboardInterrupt):
        return "interrupted"
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def run_dir_of(checkpoint: Path) -> Path | None:
    """The run folder a checkpoint belongs to (``RUN/final`` or ``RUN/checkpoints/step-N``);
    None for a checkpoint of no run (``ckpt import``'s, a user's own folder), whose parent
    folder is no place for a run's outputs."""
    if checkpoint.parent.name == "checkpoints":
        return checkpoint.parent.parent
    return checkpoint.parent if checkpoint.name == "final" else None


def launch_with_restarts(
    worker, config: TrainConfig, devices: int, run_dir: Path, resume_from: Path | None
) -> list[Any]:
    """Launch the workers; after a failure, relaunch from the newest checkpoint, up to
    ``max_restarts`` times.

    A restart is a fresh launch rather than torch's elastic agent: our workers are started
    by ``paratrain.launch`` (or torchrun, which has its own ``--max-restarts``), and the
    checkpoint is what carries the state across, so a new set of processes is all it takes.
    """
    attempt = 0
    while True:
        try:
            return paratrain.launch(
                worker,
                devices=devices,
                args=(config, str(run_dir), str(resume_from) if resume_from else None, attempt),
                backend=config.backend,
                timeout_s=config.timeout,
            )
        except WorkerError as error:
            described = strategy_class(config.strategy)
            in_memory = described.elastic_in_memory(config.strategy_options())
            if config.elastic and (not in_memory or lost_state(error)):
                devices, resume_from = go_on_from_checkpoint(config, error, run_dir, devices)
                attempt += 1
                continue
            if attempt >= config.max_restarts or error.terminated:  # SIGTERM: no restart
                raise
            if config.elastic:  # its restarts were replacement workers (runtime/elastic)
                raise
            attempt += 1
            resume_from = latest_checkpoint(run_dir)
            where = f"checkpoint {resume_from}" if resume_from else "the start"
            print(
                f"paratrain: worker {error.rank} failed; restarting from {where} "
                f"(restart {attempt} of {config.max_restarts}).\n{error.details.strip()}",
                file=sys.stderr,
            )


def checkpoint_metadata(
    config: TrainConfig, loader: GlobalBatchLoader, eval_loader: GlobalBatchLoader
) -> dict[str, Any]:
    """What a checkpoint carries besides the engine's state: the config and where both
    loaders stand. The evaluation loader cycles through the test split a few batches at a
    time, so its position decides which batches the next evaluation sees: a resume
    without it would evaluate other batches than the uninterrupted run."""
    return {
        "config": as_dict(config),
        "data": loader.state_dict(),
        "eval_data": eval_loader.state_dict(),
    }


def prune(run_dir: Path, keep: int) -> None:
    """Keep the newest ``keep`` periodic checkpoints."""
    periodic = sorted((run_dir / "checkpoints").glob("step-*"))
    for old in periodic[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
