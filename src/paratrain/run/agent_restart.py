"""A job torchrun's agent restarted (``--max-restarts``) resumes from its newest checkpoint.

Why here and without a flag: under ``torchrun --nnodes MIN:MAX --max-restarts N`` the
agent starts every worker again when one fails or a node is lost, at whatever size the
new rendezvous reached, with the same command line. The run folder and its checkpoints
(which load at any worker count) are what carry the state across, so the restarted job
(``TORCHELASTIC_RESTART_COUNT`` above 0) resumes from the folder's newest complete
checkpoint, exactly as ``--resume RUN`` would, and says so.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

from paratrain.checkpoints.locate import latest_checkpoint
from paratrain.config import ConfigError, TrainConfig
from paratrain.runtime.external_job import in_external_job, is_main_process

__all__ = ["resume_after_agent_restart"]


def agent_restarts() -> int:
    """How many times torchrun's agent has restarted this job (0 outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) if in_external_job() else 0


def resume_after_agent_restart(config: TrainConfig) -> TrainConfig:
    """``config`` as the restarted job runs it: resumed from ``--run-dir``'s newest
    checkpoint (or, where the first attempt saved none, started over in that folder)."""
    restarts = agent_restarts()
    if restarts == 0 or config.resume:
        return config
    if not config.run_dir:
        raise ConfigError(
            "torchrun restarted this job, but without --run-dir the restarted job cannot "
            "find the first attempt's checkpoints (each attempt names its own folder); "
            "pass --run-dir."
        )
    newest = latest_checkpoint(Path(config.run_dir))
    if newest is None:
        _say(
            f"restart {restarts} by torchrun; {config.run_dir} holds no checkpoint yet, so "
            "the job starts over there."
        )
        return replace(config, overwrite=True)
    _say(f"restart {restarts} by torchrun; resuming from the newest checkpoint, {newest}.")
    return replace(config, resume=str(config.run_dir))


def _say(line: str) -> None:
    if is_main_process():
        print(f"paratrain: {line}", file=sys.stderr)
