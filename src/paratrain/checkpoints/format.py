"""Canonical checkpoints: safetensors shards plus a JSON manifest, written atomically.

Layout of a checkpoint folder::

    manifest.json            format, version, the layout it was saved from, step, metadata,
                             optimizer hyperparameters, tied names, and a sha256 per file
    model-<rank>.safetensors model tensors in canonical names (the single-device model's keys)
    optim-<rank>.safetensors optimizer state as "<parameter name>/<state key>"
    rng-<rank>.safetensors   each worker's random-number-generator state

Every worker that owns a distinct part of the state writes its own shard (a dp replica's
copy is written once, each pipeline stage writes its layers), so no worker has to hold the
whole model. Readers open shards lazily and take only the names they need, which is what
makes a checkpoint load at any device count and under any strategy. Nothing here ever
unpickles: tensors are safetensors, everything else is JSON. The folder is assembled under a
temporary name and renamed into place, so a crash mid-save never leaves a half-written
checkpoint where a good one was.

Tied weights (one tensor under several names, as an output head sharing the embedding) are
stored once, under the canonical name (the one ``named_parameters()`` gives), and the
manifest lists the other names as ``"aliases": {"model": {alias: canonical}}``. Readers
answer an alias with the canonical tensor, so ``load_model_state`` returns every name the
model's ``state_dict()`` has; optimizer state is keyed by canonical names only.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from paratrain.checkpoints.file_modes import match_umask

FORMAT_NAME = "paratrain-checkpoint"
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
KINDS = ("model", "optim", "rng")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as it is; the message names the file and the fault."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint the disk would not take (full, read-only): one sentence, the staging
    folder removed. A ``CheckpointError`` so that the command line says it as one line
    wherever it is raised (in a worker, or in a torchrun rank)."""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def shard_name(kind: str, rank: int) -> str:
    return f"{kind}-{rank}.safetensors"


def staging_dir(directory: str | Path) -> Path:
    """Where a checkpoint is assembled before the rename; the same for every worker."""
    directory = Path(directory)
    return directory.parent / f".{directory.name}.partial"


def write_shard(folder: Path, kind: str, rank: int, tensors: dict[str, torch.Tensor]) -> dict:
    """Write one shard file; returns its manifest entry (sha256 and size)."""
    path = folder / shard_name(kind, rank)
    try:
        save_file({k: t.detach().to("cpu").contiguous() for k, t in tensors.items()}, str(path))
    except SafetensorError as error:
        raise disk_error(error) from error
    match_umask(path)  # save_file creates 0600 files whatever the umask
    return {"sha256": file_sha256(path), "bytes": path.stat().st_size, "kind": kind}


def disk_error(error: SafetensorError) -> OSError | SafetensorError:
    """safetensors' write error as the ``OSError`` it wraps ("I/O error: No space left on
    device (os error 28)"), so that a full disk is told apart from a bad tensor; any
    other error as it was."""
    found = re.search(r"\(os error (\d+)\)", str(error))
    if not found:
        return error
    code = int(found.group(1))
    return OSError(code, os.strerror(code))


def publish(directory: str | Path, manifest: dict[str, Any]) -> Path:
    """Write the manifest into the staging folder and rename it into place, atomically."""
    directory = Path(directory)
    staging = staging_dir(directory)
    manifest = {"format": FORMAT_NAME, "version": FORMAT_VERSION, **manifest}
    path = staging / MANIFEST
    with path.open("w") as handle:
        handle.write(json.dumps(manifest, indent=2, sort_keys=True))
        handle.flush()
        os.fsync(handle.fileno())
    retired = directory.parent / f".{directory.name}.old"
    if retired.exists():
        shutil.rmtree(retired)
    if directory.exists():
        os.replace(directory, retired)
    os.replace(staging, directory)
    if retired.exists():
        shutil.rmtree(retired)
    return directory


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run: periodic ones, then the final one."""
    candidates = [p for p in (run_dir / "checkpoints").glob("step-*") if (p / MANIFEST).exists()]
    if (run_dir / "final" / MANIFEST).exists():
        candidates.append(run_dir / "final")
    if not candidates:
        return None
    return max(candidates, key=lambda p: read_manifest(p).get("step", 0))


def prepare_staging(directory: str | Path) -> Path:
    """An empty staging folder (a leftover from a crashed save is discarded)."""
    staging = staging_dir(directory)
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def shared_names(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """``{alias: first name}`` for entries of ``state`` that are the same tensor view (a
    tied model's ``state_dict()``), which safetensors refuses to write twice."""
    first: dict[tuple, str] = {}
    aliases: dict[str, str] = {}
    for name, tensor in state.items():
        if tensor.device.type == "meta":
            continue
        key = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.dtype,
        )
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
    return aliases


def save_model_state(
    directory: str | Path,
    state: dict[str, torch.Tensor],
    *,
    metadata: dict[str, Any] | None = None,
    optimizer: tuple[dict[str, torch.Tensor], list[dict[str, Any]]] | None = None,
) -> Path:
    """A checkpoint written by one process: the model, and the optimizer state where given
    (tensors by "name/key" and the groups with parameter names); no RNG state.

    Entries that are one tensor under several names (tied weights) are written once and
    recorded as aliases.
    """
    aliases = shared_names(state)
    staging = prepare_staging(directory)
    entry = write_shard(staging, "model", 0, {k: v for k, v in state.items() if k not in aliases})
    files = {shard_name("model", 0): entry}
    if optimizer is not None:
        files[shard_name("optim", 0)] = write_shard(staging, "optim", 0, optimizer[0])
    return publish(
        directory,
        {
            "layout": {"strategy": "single", "world_size": 1},
            "step": (metadata or {}).get("step", 0),
            "metadata": metadata or {},
            "files": files,
            "optimizer": None if optimizer is None else {"param_groups": optimizer[1]},
            **alias_entry(aliases),
        },
    )


def alias_entry(aliases: dict[str, str]) -> dict[str, Any]:
    """The manifest's record of tied model names (nothing when there are none)."""
    return {"aliases": {"model": dict(sorted(aliases.items()))}} if aliases else {}


class Checkpoint:
    """A verified checkpoint folder, read lazily by tensor name."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.manifest = read_manifest(self.directory)
        self._handles: dict[str, Any] = {}
        self._index: dict[str, dict[str, str]] = {kind: {} for kind in KINDS}
        self._stored: dict[str, dict[str, str]] = {kind: {} for kind in KINDS}
        """Per kind, a name presented otherwise than stored -> its stored name."""
        for name, entry in self.manifest["files"].items():
            self._handles[name] = self._verified_handle(name, entry)
            for key in self._handles[name].keys():
                self._index[entry["kind"]][key] = name
        self.aliases: dict[str, str] = dict((self.manifest.get("aliases") or {}).get("model", {}))
        """Tied model names: ``{alias: canonical}``; the canonical tensor answers both."""
        for alias, canonical in self.aliases.items():
            if canonical not in self._index["model"] or alias in self._index["model"]:
                raise CheckpointError(
                    f"{self.directory / MANIFEST} ties {alias!r} to {canonical!r}, but the "
                    "model files hold "
                    + (f"{alias!r} itself" if alias in self._index["model"] else "neither")
                    + ": the checkpoint is damaged."
                )

    def _verified_handle(self, name: str, entry: dict[str, Any]):
        """Open one shard once its size and checksum match the manifest."""
        path = self.directory / name
        if not path.exists():
            raise CheckpointError(f"{path} is missing from the checkpoint.")
        if path.stat().st_size != entry["bytes"]:
            raise CheckpointError(
                f"{path} is truncated or was changed after saving ({path.stat().st_size} "
                f"bytes, the manifest says {entry['bytes']})."
            )
        actual = file_sha256(path)
        if actual != entry["sha256"]:
            raise CheckpointError(
                f"{path} is damaged or was changed after saving (sha256 {actual[:12]}..., "
                f"the manifest says {entry['sha256'][:12]}...)."
            )
        try:
            return safe_open(str(path), framework="pt")
        except Exception as error:  # safetensors raises its own error types
            raise CheckpointError(f"{path} is not a readable safetensors file: {error}.") from None

    def present_names(self, rename: Callable[[str], str]) -> None:
        """From now on, answer to ``rename(stored)`` for each model and optimizer tensor's
        stored name, in the optimizer's parameter groups and the tied aliases too: a model
        compiled by torch.compile names its tensors with ``_orig_mod.`` where the same model
        uncompiled does not, and either loads the other's checkpoint
        (``wrapper_names.renaming_for``). Called once, before any read."""
        for kind in ("model", "optim"):
            index, stored = {}, {}
            for name, file in self._index[kind].items():
                shown = rename(name)
                index[shown] = file
                if shown != name:
                    stored[shown] = name
            self._index[kind], self._stored[kind] = index, stored
        self.aliases = {rename(a): rename(c) for a, c in self.aliases.items()}
        for group in (self.manifest.get("optimizer") or {}).get("param_groups", []):
            group["params"] = [rename(name) for name in group["params"]]

    @property
    def step(self) -> int:
        return int(self.manifest.get("step", 0))

    @property
    def metadata(self) -> dict[str, Any]:
        return self.manifest.get("metadata", {})

    def names(self, kind: str) -> list[str]:
        """Every name a ``kind`` tensor can be read by (tied aliases included)."""
        if kind == "model":
            return sorted([*self._index[kind], *self.aliases])
        return sorted(self._index[kind])

    def stored(self, kind: str, name: str) -> bool:
        """Whether ``name`` is a tensor of its own in the files (not absent, not an alias)."""
        return name in self._index[kind]

    def tensor(self, kind: str, name: str) -> torch.Tensor:
        if kind == "model":
            name = self.aliases.get(name, name)
        file = self._index[kind].get(name)
        if file is None:
            raise CheckpointError(f"{self.directory} holds no {kind} tensor named {name!r}.")
        return self._handles[file].get_tensor(self._stored[kind].get(name, name))

    def shape(self, kind: str, name: str) -> tuple[int, ...]:
        """A tensor's shape, read from the file's header without loading the tensor."""
        if kind == "model":
            name = self.aliases.get(name, name)
        file = self._index[kind].get(name)
        if file is None:
            raise CheckpointError(f"{self.directory} holds no {kind} tensor named {name!r}.")
        stored = self._stored[kind].get(name, name)
        return tuple(self._handles[file].get_slice(stored).get_shape())

    def tensors(
        self, kind: str, names: list[str] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.names(kind) if names is None else names:
            yield name, self.tensor(kind, name)

    def model_state(self) -> dict[str, torch.Tensor]:
        """Every model name, as ``state_dict()`` has them: a tied alias is the same tensor
        object as its canonical name (read once)."""
        state = dict(self.tensors("model", sorted(self._index["model"])))
        for alias, canonical in self.aliases.items():
            state[alias] = state[canonical]
        return dict(sorted(state.items()))


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The manifest of a checkpoint folder, checked for format and version."""
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} is missing; {directory} is not a paratrain checkpoint."
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path} is damaged (not valid JSON: {error}).") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{path} is not a paratrain checkpoint manifest.")
    if manifest.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has format version {manifest.get('version')}; this paratrain reads "
            f"version {FORMAT_VERSION}."
        )
    return manifest


def load_model_state(directory: str | Path) -> dict[str, torch.Tensor]:
    """A plain model state dict (canonical names) for ``model.load_state_dict``, verified.

    Holds every name the saved model's ``state_dict()`` had: tied names share one tensor.
    """
    return Checkpoint(directory).model_state()
