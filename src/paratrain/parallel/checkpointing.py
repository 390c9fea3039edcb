"""Saving and loading an engine's whole training state in canonical names.

Works on any engine through a few hooks it exposes (``named_local_state``,
``named_local_parameters``, ``writes_shard``, ``optimizer``), so every strategy saves
and every strategy loads, at any device count: a worker writes the part of the state it
owns, and a worker loading takes, by name, the part it now needs.
Engines whose state is flat-sharded (ZeRO) implement ``ShardedCheckpointState`` instead.

Tied weights (``ties``): the engine's ``tied_names()`` says which model names are aliases
of another; a worker writes only canonical names (a pipeline stage holding only the
alias of a tensor another stage holds writes nothing for it), the manifest records the
aliases, and optimizer state goes under canonical names.

Split layers (``engine.tensor_split``, see ``tensor/split.py``): every worker that holds a
writer's part joins its slices with the rest of its tensor group, and the group's first
member writes the whole tensors; loading cuts each tensor read to this worker's slice. So
the format, and what loads where, do not depend on the tensor degree either.
"""

from __future__ import annotations

import random
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from paratrain.checkpoints.format import (
    Checkpoint,
    CheckpointError,
    CheckpointWriteError,
    alias_entry,
    latest_checkpoint,
    prepare_staging,
    publish,
    staging_dir,
    write_shard,
)
from paratrain.checkpoints.wrapper_names import renaming_for
from paratrain.parallel.optim_state import load_named_optimizer_state, named_optimizer_state
from paratrain.runtime import comm


class CheckpointHooks(Protocol):
    """What saving and loading ask of an engine (``Engine`` provides defaults for all)."""

    optimizer: torch.optim.Optimizer | None
    steps_taken: int
    device: torch.device

    def named_local_state(self) -> dict[str, torch.Tensor]: ...
    def named_local_parameters(self) -> list[tuple[str, torch.nn.Parameter]]: ...
    def tied_names(self) -> dict[str, str]: ...
    def writes_shard(self) -> bool: ...
    def covers_whole_model(self) -> bool: ...
    def layout(self) -> dict[str, Any]: ...


class ShardedCheckpointState:
    """Mixin for engines whose tensors are flat slices that cut across parameters (ZeRO).

    The default checkpoint hooks hand over whole live parameters; a flat slice is not one.
    Such an engine instead gathers canonical tensors for the writer and, when loading,
    takes its own slices, so its checkpoints keep the common format and load into any
    engine at any device count (and any checkpoint loads into it).
    """

    def gather_checkpoint_state(
        self,
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[dict[str, Any]]]:
        """(model tensors, optimizer tensors by "name/key", optimizer groups), canonical.

        Every worker calls it (it is collective); workers that do not write may get
        empty results.
        """
        raise NotImplementedError

    def load_checkpoint_state(self, checkpoint: Checkpoint) -> None:
        """Take this worker's slices of the model and optimizer state from ``checkpoint``."""
        raise NotImplementedError


def _python_rng() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def save_engine_checkpoint(
    engine: CheckpointHooks, directory: str | Path, *, metadata: dict[str, Any] | None = None
) -> Path:
    """Every worker calls this; returns the published checkpoint folder."""
    directory, rank = Path(directory), comm.rank()
    if rank == 0:
        prepare_staging(directory)
    if comm.distributed():
        comm.barrier("checkpoint barrier")
    staging = staging_dir(directory)
    files: dict[str, dict] = {}
    groups = None
    aliases = engine.tied_names()
    split = engine_split(engine)
    holds = engine.writes_shard()  # a writer's part; under a split, joined over the group
    writes = holds and (split is None or split.rank == 0)
    model_state: dict[str, torch.Tensor] = {}
    optim_tensors: dict[str, torch.Tensor] = {}
    if isinstance(engine, ShardedCheckpointState):
        model_state, optim_tensors, groups = engine.gather_checkpoint_state()
        model_state = {k: v for k, v in model_state.items() if k not in aliases}
    elif holds:
        local = engine.named_local_parameters()
        names = {id(p): aliases.get(name, name) for name, p in local}
        owned = {name for name, _ in local if name not in aliases}
        model_state = {k: v for k, v in engine.named_local_state().items() if k not in aliases}
        if engine.optimizer is not None:
            optim_tensors, groups = named_optimizer_state(engine.optimizer, names)
            optim_tensors = {
                k: v for k, v in optim_tensors.items() if k.rpartition("/")[0] in owned
            }
            groups = [{**g, "params": [n for n in g["params"] if n in owned]} for g in groups]
    if split is not None and holds:
        model_state = split.whole_state(model_state)
        optim_tensors = split.whole_optimizer(optim_tensors)
    if not writes:
        groups = None
    shards = {"model": model_state, "optim": optim_tensors} if writes else {}
    if engine.optimizer is None:
        shards.pop("optim", None)
    rng = {"torch_cpu": torch.get_rng_state()}
    if engine.device.type == "cuda":
        rng["torch_cuda"] = torch.cuda.get_rng_state(engine.device)
    shards["rng"] = {f"{key}/{rank}": value for key, value in rng.items()}
    failure = _write_shards(staging, rank, shards, files)
    part = {"files": files, "groups": groups or [], "python_rng": _python_rng(), "failure": failure}
    parts = [part]
    if comm.distributed():  # to every rank: a failed write is known to all
        parts = [None] * comm.world_size()
        dist.all_gather_object(parts, part)
    failures = [p["failure"] for p in parts if p["failure"]]
    if failures:
        _abandon(directory, failures[0])
    if rank == 0:
        _publish_or_abandon(
            directory,
            {
                "layout": engine.layout(),
                "step": engine.steps_taken,
                "metadata": metadata or {},
                "files": {k: v for p in parts for k, v in p["files"].items()},
                "optimizer": {"param_groups": [g for p in parts for g in p["groups"]]},
                "python_rng": {str(r): p["python_rng"] for r, p in enumerate(parts)},
                **alias_entry(aliases),
            },
        )
    if comm.distributed():
        comm.barrier("checkpoint barrier")
    return directory


def _write_shards(
    staging: Path, rank: int, shards: dict[str, dict[str, torch.Tensor]], files: dict
) -> str | None:
    """Write this worker's shards into the staging folder, entries into ``files``; the
    reason (``strerror``: "No space left on device") where the disk refused a write, so
    that every worker can stop alike rather than one of them with a traceback."""
    try:
        for kind, tensors in shards.items():
            files[f"{kind}-{rank}.safetensors"] = write_shard(staging, kind, rank, tensors)
    except OSError as error:
        return error.strerror or str(error)
    return None


def _publish_or_abandon(directory: Path, manifest: dict[str, Any]) -> None:
    try:
        publish(directory, manifest)
    except OSError as error:
        _abandon(directory, error.strerror or str(error))


def _abandon(directory: Path, reason: str) -> None:
    """A save the disk refused: the staging folder removed (by rank 0, every rank waiting
    for it, so none is stopped before it is gone), the published checkpoints untouched,
    and every worker raises the one sentence."""
    if comm.rank() == 0:
        shutil.rmtree(staging_dir(directory), ignore_errors=True)
    if comm.distributed():
        comm.barrier("checkpoint barrier")
    raise write_refused(directory, reason)


def write_refused(directory: Path, reason: str) -> CheckpointWriteError:
    """The one sentence for a checkpoint the disk refused (``reason``: the OS's words, "No
    space left on device"), naming the newest complete checkpoint the run keeps. Said
    alike by every engine (ps's servers write their shards too), once the caller has
    removed the staging folder."""
    run_dir = (
        directory.parent.parent if directory.parent.name == "checkpoints" else directory.parent
    )
    kept = latest_checkpoint(run_dir)
    kept_line = (
        f"the last complete checkpoint, {kept}, is kept"
        if kept
        else "no complete checkpoint was saved before it"
    )
    return CheckpointWriteError(
        f"could not save checkpoint {directory}: {reason}; its partial files were removed "
        f"and {kept_line}; free space (or pick a writable --run-dir) and --resume the run."
    )


def load_engine_checkpoint(engine: CheckpointHooks, directory: str | Path) -> Checkpoint:
    """Every worker calls this; each takes, by name, the state its layout now needs."""
    checkpoint = Checkpoint(directory)
    local = engine.named_local_state()
    checkpoint.present_names(renaming_for(local))  # compiled or not, one model
    saved = set(checkpoint.names("model"))
    missing = sorted(set(local) - saved)
    if missing:
        raise CheckpointError(
            f"{checkpoint.directory} has no {missing[0]!r} ({len(missing)} model tensor(s) "
            "missing): it was saved from a different model."
        )
    if engine.covers_whole_model() and saved - set(local):
        extra = sorted(saved - set(local))
        raise CheckpointError(
            f"{checkpoint.directory} holds {extra[0]!r}, which this model does not have: it was "
            "saved from a different model."
        )
    aliases = engine.tied_names()
    check_ties(checkpoint, aliases, local)
    split = engine_split(engine)
    reader = checkpoint if split is None else split.sliced(checkpoint)
    if isinstance(engine, ShardedCheckpointState):
        engine.load_checkpoint_state(reader)
        _restore_rng(engine, checkpoint, split)
        engine.steps_taken = checkpoint.step
        return checkpoint
    with torch.no_grad():
        for name, tensor in local.items():
            if aliases.get(name) not in local:  # a tied tensor is written once
                tensor.copy_(reader.tensor("model", name))
    optimizer_meta = checkpoint.manifest.get("optimizer")
    if engine.optimizer is not None and optimizer_meta:
        state_keys: dict[str, list[str]] = defaultdict(list)
        for key in checkpoint.names("optim"):
            name, _, state_key = key.rpartition("/")
            state_keys[name].append(state_key)
        names = {id(p): aliases.get(name, name) for name, p in engine.named_local_parameters()}
        load_named_optimizer_state(
            engine.optimizer,
            names,
            optimizer_meta["param_groups"],
            state_keys,
            lambda key: reader.tensor("optim", key),
        )
    _restore_rng(engine, checkpoint, split)
    engine.steps_taken = checkpoint.step
    return checkpoint


def engine_split(engine: Any) -> Any:
    """The engine's ``TensorSplit`` (its layers split over a tensor group), or None."""
    return getattr(engine, "tensor_split", None)


def check_ties(checkpoint: Checkpoint, aliases: dict[str, str], local) -> None:
    """Refuse a checkpoint holding two different tensors for names this model ties: one
    tensor cannot take both (it was saved from a model without the tie)."""
    for alias, canonical in aliases.items():
        stored = checkpoint.stored("model", alias) and checkpoint.stored("model", canonical)
        if alias not in local or not stored:
            continue
        saved = checkpoint.tensor("model", alias), checkpoint.tensor("model", canonical)
        if not torch.equal(*saved):
            raise CheckpointError(
                f"{checkpoint.directory} holds different values for {canonical!r} and "
                f"{alias!r}, which this model ties (one tensor): it was saved from a model "
                "without the tie; untie the model to load it."
            )


def _restore_rng(engine: CheckpointHooks, checkpoint: Checkpoint, split: Any = None) -> None:
    """This rank's saved generator states, so that it continues its own random stream.

    A rank the saving layout did not have keeps the stream its engine gave it at setup
    (``replica_rng``): taking another rank's would make two workers draw the same dropout
    masks. Streams of ranks the loading layout lacks are dropped. The members of a tensor
    group then take their first member's stream again (``split``): a checkpoint of another
    layout may have given them different ones.
    """
    _restore_own_rng(engine, checkpoint)
    if split is not None:
        split.share_stream(engine.device)


def _restore_own_rng(engine: CheckpointHooks, checkpoint: Checkpoint) -> None:
    rank = comm.rank()
    if f"torch_cpu/{rank}" not in checkpoint.names("rng"):
        return
    torch.set_rng_state(checkpoint.tensor("rng", f"torch_cpu/{rank}"))
    if engine.device.type == "cuda" and f"torch_cuda/{rank}" in checkpoint.names("rng"):
        torch.cuda.set_rng_state(checkpoint.tensor("rng", f"torch_cuda/{rank}"), engine.device)
    python = checkpoint.manifest.get("python_rng", {}).get(str(rank))
    if python:
        random.setstate((python[0], tuple(python[1]), python[2]))
