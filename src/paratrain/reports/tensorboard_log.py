"""``--tensorboard``: the run's metrics as TensorBoard event files, beside metrics.jsonl.

Users of Lightning and torchrun scripts already open TensorBoard, so the same figures the
trainer writes to ``metrics.jsonl`` (train and eval records: loss, accuracy, samples/s,
bytes sent, ...) are mirrored, as they are written, through ``torch.utils.tensorboard``
into ``RUN/tensorboard``; ``tensorboard --logdir RUN/tensorboard`` shows them while the run
trains. A resumed run adds a new event file to the same folder, which TensorBoard reads
as one series. The package is optional: asking for it without ``tensorboard`` installed
is refused before any worker starts.
"""

from __future__ import annotations

import importlib.util
import numbers
from pathlib import Path
from typing import Any

from paratrain.config import ConfigError, TrainConfig

__all__ = ["MIRRORED_KINDS", "TensorBoardMirror", "check_tensorboard", "tensorboard_dir"]

MIRRORED_KINDS = ("train", "eval")
"""The records that are series over steps; memory and summary records are one-off
tables, left to ``paratrain report``."""

NOT_SCALARS = ("step", "time_s", "epoch")
"""Fields that place a record rather than measure something."""


def tensorboard_dir(run_dir: str | Path) -> Path:
    """Where a run's event files go."""
    return Path(run_dir) / "tensorboard"


def check_tensorboard(config: TrainConfig) -> None:
    """Refuse ``--tensorboard`` where the package that writes the files is missing, before
    any worker starts (or the planner spends its time)."""
    if config.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "--tensorboard needs the tensorboard package; install it with "
            "`pip install tensorboard` or drop --tensorboard."
        )


class TensorBoardMirror:
    """Writes each train or eval record's numeric fields as scalars ``<kind>/<field>``
    at the record's step (``train/loss``, ``eval/loss``, ``eval/accuracy``, ...)."""

    def __init__(self, run_dir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(tensorboard_dir(run_dir)))

    def write(self, kind: str, values: dict[str, Any]) -> None:
        if kind not in MIRRORED_KINDS or "step" not in values:
            return
        for name, value in values.items():
            if name in NOT_SCALARS or isinstance(value, bool):
                continue
            if isinstance(value, numbers.Real):
                tag = f"{kind}/{name.removeprefix(kind + '_')}"  # eval_loss: eval/loss
                self._writer.add_scalar(tag, float(value), values["step"])

    def close(self) -> None:
        self._writer.close()
