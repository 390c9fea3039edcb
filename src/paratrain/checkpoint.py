"""Canonical checkpoints: safetensors files plus a JSON manifest, written atomically.

Names are the single-device model's own keys (never a ``module.`` prefix), so any
strategy, or plain PyTorch, can load what any strategy saved. Nothing here ever unpickles:
tensors are safetensors, metadata is JSON. A checkpoint folder is assembled under a
temporary name and renamed into place, so a crash mid-save never leaves a half-written
checkpoint where a good one was.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

FORMAT_NAME = "paratrain-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MODEL_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as it is; the message names the file and the fault."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_write(path: Path, text: str) -> None:
    with path.open("w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def save_model_state(
    directory: str | Path, state: dict[str, torch.Tensor], *, metadata: dict[str, Any] | None = None
) -> Path:
    """Write ``state`` (canonical keys) as a checkpoint folder; replaces any old one."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = directory.parent / f".{directory.name}.partial-{os.getpid()}"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in state.items()}
    save_file(tensors, str(staging / MODEL_FILE))
    manifest = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "files": {MODEL_FILE: _sha256(staging / MODEL_FILE)},
        "metadata": metadata or {},
    }
    _fsync_write(staging / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True))
    retired = directory.parent / f".{directory.name}.old-{os.getpid()}"
    if directory.exists():
        os.replace(directory, retired)
    os.replace(staging, directory)
    if retired.exists():
        shutil.rmtree(retired)
    return directory


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The manifest of a checkpoint folder, checked for format and version."""
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} is missing; {directory} is not a paratrain checkpoint."
        ) from None
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path} is damaged (not valid JSON: {error}).") from None
    if manifest.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{path} is not a paratrain checkpoint manifest.")
    if manifest.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has format version {manifest.get('version')}; this paratrain reads "
            f"version {FORMAT_VERSION}."
        )
    return manifest


def load_model_state(directory: str | Path) -> dict[str, torch.Tensor]:
    """A plain model state dict from a checkpoint folder, after verifying its checksum."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    expected = manifest["files"].get(MODEL_FILE)
    path = directory / MODEL_FILE
    if expected is None or not path.exists():
        raise CheckpointError(f"{path} is missing from the checkpoint.")
    actual = _sha256(path)
    if actual != expected:
        raise CheckpointError(
            f"{path} is damaged or was changed after saving (checksum {actual[:12]}..., "
            f"manifest says {expected[:12]}...)."
        )
    return load_file(str(path))
