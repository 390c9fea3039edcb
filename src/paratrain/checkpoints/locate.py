"""Which checkpoint a path means: a checkpoint folder itself, or a run folder's newest.

Apart from ``resume.py`` (which starts workers) so that reading a model's weights
(``paratrain.load_model_state``) can find a run's newest checkpoint without importing the
launcher.
"""

from __future__ import annotations

from pathlib import Path

from paratrain.checkpoints.format import MANIFEST, Checkpoint, CheckpointError, read_manifest
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


def intact_before(run_dir: Path, damaged: Path) -> Path | None:
    """The newest checkpoint of ``run_dir`` other than ``damaged`` that passes every check:
    what a refusal of a damaged newest checkpoint offers instead."""
    candidates = [p for p in (run_dir / "checkpoints").glob("step-*") if (p / MANIFEST).exists()]
    if (run_dir / "final" / MANIFEST).exists():
        candidates.append(run_dir / "final")
    steps = {}
    for path in candidates:
        if path.resolve() == damaged.resolve():
            continue
        try:
            steps[path] = int(read_manifest(path).get("step", 0))
        except CheckpointError:
            continue
    for path in sorted(steps, key=steps.__getitem__, reverse=True):
        try:
            Checkpoint(path)
        except CheckpointError:
            continue
        return path
    return None
