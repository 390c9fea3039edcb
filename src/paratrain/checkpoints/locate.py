"""Which checkpoint a path means: a checkpoint folder itself, or a run folder's newest.

Apart from ``resume.py`` (which starts workers) so that reading a model's weights
(``paratrain.load_model_state``) can find a run's newest checkpoint without importing the
launcher.
"""

from __future__ import annotations

from pathlib import Path

from paratrain.checkpoints.format import MANIFEST
from paratrain.checkpoints.format import latest_checkpoint as latest_checkpoint  # its old home
from paratrain.config import ConfigError


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
