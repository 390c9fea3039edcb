"""Surviving interruptions: where to resume from, restarts after a failed worker, pruning.

The checkpoint carries all state across (model, optimizer, RNG, the data loader's
position), so resuming, at any device count, and restarting after a crash are the same
thing: start fresh workers and load the newest complete checkpoint.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import paratrain
from paratrain.checkpoint import MANIFEST, read_manifest
from paratrain.config import ConfigError, TrainConfig, as_dict
from paratrain.data import GlobalBatchLoader
from paratrain.runtime import comm
from paratrain.runtime.launch import WorkerError


def find_checkpoint(path: str | Path) -> Path:
    """The checkpoint to resume from: ``path`` itself, or the newest one in a run folder."""
    path = Path(path)
    if (path / MANIFEST).exists():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise ConfigError(
            f"{path} holds no checkpoint (no manifest.json, no checkpoints/step-*, no final/); "
            "pass a run folder written with --checkpoint-every or a checkpoint folder."
        )
    return latest


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run: periodic ones, then the final one."""
    candidates = [p for p in (run_dir / "checkpoints").glob("step-*") if (p / MANIFEST).exists()]
    if (run_dir / "final" / MANIFEST).exists():
        candidates.append(run_dir / "final")
    if not candidates:
        return None
    return max(candidates, key=lambda p: read_manifest(p).get("step", 0))


def run_dir_of(checkpoint: Path) -> Path:
    """The run folder a checkpoint belongs to (``RUN/final`` or ``RUN/checkpoints/step-N``)."""
    return (
        checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint.parent
    )


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
            if attempt >= config.max_restarts or error.terminated:  # SIGTERM: no restart
                raise
            attempt += 1
            resume_from = latest_checkpoint(run_dir)
            where = f"checkpoint {resume_from}" if resume_from else "the start"
            print(
                f"paratrain: worker {error.rank} failed; restarting from {where} "
                f"(restart {attempt} of {config.max_restarts}).\n{error.details.strip()}",
                file=sys.stderr,
            )


def inject_fault(step: int, attempt: int) -> None:
    """Fault injection for tests and drills: PARATRAIN_FAULT="kill:<rank>:<step>" SIGKILLs
    that worker at that step, on the first attempt only (a restart then runs clean)."""
    fault = os.environ.get("PARATRAIN_FAULT", "")
    if attempt == 0 and fault == f"kill:{comm.rank()}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def checkpoint_metadata(config: TrainConfig, loader: GlobalBatchLoader) -> dict[str, Any]:
    return {"config": as_dict(config), "data": loader.state_dict()}


def prune(run_dir: Path, keep: int) -> None:
    """Keep the newest ``keep`` periodic checkpoints."""
    periodic = sorted((run_dir / "checkpoints").glob("step-*"))
    for old in periodic[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
