"""Checkpoints of a ps run: the servers write and read their own shards.

The format is the one every engine writes (``paratrain.checkpoint``), so a ps checkpoint
loads into any engine and any checkpoint loads into ps, by canonical name. What differs
is who writes: each server writes its parameters and optimizer state as
``model-<server>``/``optim-<server>``, and one worker writes the rest (its buffers, its
random-number state) and publishes the manifest.

Which worker: the first to reach the call (``engine.claim``). Workers reach a given save
at different times under asynchrony, and waiting for the others would hang on a lost one,
so a save is a snapshot of the servers at the moment the first worker asks, and the other
workers return at once (their ``save_checkpoint`` does not wait for the folder to appear).
A load is done once by the first worker; the others wait, bounded, for it to finish, since
none may train on the parameters from before the load.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from paratrain.checkpoint import (
    Checkpoint,
    CheckpointError,
    prepare_staging,
    publish,
    shard_name,
    write_shard,
)
from paratrain.parallel.checkpointing import _python_rng, _restore_rng
from paratrain.parallel.parameter_server.protocol import Op

if TYPE_CHECKING:
    from paratrain.parallel.parameter_server.engine import ParameterServerEngine


def _buffers(engine: ParameterServerEngine) -> dict[str, torch.Tensor]:
    """The persistent buffers of the model (the parameters live on the servers)."""
    names = {name for name, _ in engine.model.named_parameters()}
    return {k: v for k, v in engine.model.state_dict().items() if k not in names}


def save(engine: ParameterServerEngine, directory: Path, metadata: dict) -> Path:
    """Publish a checkpoint of the servers' current state, if this worker is first."""
    engine.wait_for_bound()  # with staleness=0: every live worker's pushes up to this step
    first, _ = engine.claim("save")
    if not first:
        return directory
    staging = prepare_staging(directory)
    replies = engine.link.send_json(Op.SAVE, [{"staging": str(staging)}] * engine.servers)
    files: dict[str, dict] = {}
    groups: list[dict] = []
    for reply in replies:
        files.update(reply["files"])
        groups += reply["groups"]
    buffers = _buffers(engine)
    if buffers:
        files[shard_name("model", engine.servers)] = write_shard(
            staging, "model", engine.servers, buffers
        )
    files[shard_name("rng", 0)] = write_shard(
        staging, "rng", 0, {"torch_cpu/0": torch.get_rng_state()}
    )
    return publish(
        directory,
        {
            "layout": engine.layout(),
            "step": engine.steps_taken,
            "metadata": metadata,
            "files": files,
            "optimizer": {"param_groups": groups},
            "python_rng": {"0": _python_rng()},
        },
    )


def load(engine: ParameterServerEngine, directory: Path) -> Checkpoint:
    """Load ``directory`` into the servers (once) and this worker's buffers and RNG."""
    checkpoint = Checkpoint(directory)
    local = set(engine.model.state_dict())
    saved = set(checkpoint.names("model"))
    if local - saved or saved - local:
        odd = sorted((local - saved) or (saved - local))
        raise CheckpointError(
            f"{checkpoint.directory} does not match this model ({odd[0]!r} is in one and not "
            "the other): it was saved from a different model."
        )
    first, key = engine.claim("load")
    if first:
        try:
            engine.link.send_json(Op.LOAD, [{"path": str(directory)}] * engine.servers)
        except Exception as error:
            engine.store.set(f"{key}/done", f"error: {error}")
            raise
        engine.store.set(f"{key}/done", "ok")
    else:
        engine.store.wait([f"{key}/done"], timedelta(seconds=engine.timeout_s))
        outcome = engine.store.get(f"{key}/done").decode()
        if outcome != "ok":
            raise CheckpointError(f"loading {directory} failed on another worker: {outcome}")
    with torch.no_grad():
        for name, tensor in _buffers(engine).items():
            tensor.copy_(checkpoint.tensor("model", name))
    _restore_rng(engine, checkpoint)
    engine.steps_taken = checkpoint.step
    return checkpoint
