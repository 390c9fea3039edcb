"""Checkpoints of a ps run: the servers write and read their own shards.

The format is the one every engine writes (``paratrain.checkpoints.format``), so a ps checkpoint
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

import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from paratrain.checkpoints.format import (
    Checkpoint,
    CheckpointError,
    alias_entry,
    prepare_staging,
    publish,
    shard_name,
    staging_dir,
    write_shard,
)
from paratrain.checkpoints.wrapper_names import renaming_for
from paratrain.parallel.checkpointing import _python_rng, _restore_rng, write_refused
from paratrain.parallel.model_config import with_model_config
from paratrain.parallel.ps.protocol import Op


class ServerCheckpoints:
    """The ps engine's ``save_checkpoint`` and ``load_checkpoint``: the servers write and
    read the parameters and optimizer state, a worker the buffers and RNG. The engine
    provides ``link``, ``servers``, ``store``, ``claim``, ``wait_for_bound``, ``model``,
    ``precision``, ``timeout_s``, ``layout``, ``tied_names`` and ``steps_taken``."""

    def save_checkpoint(self, path: str | Path, *, metadata: dict[str, Any] | None = None) -> Path:
        """Save the servers' parameters and optimizer state (see the module's docstring).

        Under fp16 the loss scale saved is the one of the worker that writes the checkpoint
        (each worker has its own); every worker resumes from it.
        """
        metadata = dict(metadata or {})
        if self.precision.scales_loss:
            metadata["precision"] = self.precision.state_dict()
        return self._save(Path(path), with_model_config(metadata, self.model_config))

    def load_checkpoint(self, path: str | Path) -> Checkpoint:
        """Load a checkpoint of any engine into the servers (see the module's docstring)."""
        checkpoint = self._load(Path(path))
        saved = checkpoint.metadata.get("precision")
        if saved and saved.get("name") == self.precision.name:
            self.precision.load_state_dict(saved)
        return checkpoint

    def _model_buffers(self) -> dict[str, torch.Tensor]:
        """The persistent buffers of the model (the parameters live on the servers; a tied
        parameter's other names are aliases, recorded in the manifest)."""
        names = {name for name, _ in self.model.named_parameters(remove_duplicate=False)}
        aliases = self.tied_names()
        return {k: v for k, v in self.model.state_dict().items() if k not in names | aliases.keys()}

    def _save(self, directory: Path, metadata: dict) -> Path:
        """Publish a checkpoint of the servers' current state, if this worker is first.

        A disk that refuses a shard (the servers' or this worker's) ends the save as every
        engine's does: the staging folder removed, the newest complete checkpoint kept,
        one sentence (``write_refused``). The other workers are not waited for (see the
        module's docstring): the claimant's error stops the launch, and them with it.
        """
        self.wait_for_bound()  # with staleness=0: every live worker's pushes up to this step
        first, key = self.claim("save")
        if not first:
            return self._claimed_directory(key, directory)
        self.store.set(f"{key}/directory", str(directory))
        try:
            return self._write(directory, metadata)
        except OSError as error:  # a server's arrives with its errno (protocol.reply_error)
            shutil.rmtree(staging_dir(directory), ignore_errors=True)
            raise write_refused(directory, error.strerror or str(error)) from error

    def _write(self, directory: Path, metadata: dict) -> Path:
        """The servers' shards, then this worker's buffers and RNG, then the manifest."""
        staging = prepare_staging(directory)
        replies = self.link.send_json(Op.SAVE, [{"staging": str(staging)}] * self.servers)
        files: dict[str, dict] = {}
        groups: list[dict] = []
        for reply in replies:
            files.update(reply["files"])
            groups += reply["groups"]
        buffers = self._model_buffers()
        if buffers:
            files[shard_name("model", self.servers)] = write_shard(
                staging, "model", self.servers, buffers
            )
        files[shard_name("rng", 0)] = write_shard(
            staging, "rng", 0, {"torch_cpu/0": torch.get_rng_state()}
        )
        return publish(
            directory,
            {
                "layout": self.layout(),
                "step": self.steps_taken,
                "metadata": metadata,
                "files": files,
                "optimizer": {"param_groups": groups},
                "python_rng": {"0": _python_rng()},
                **alias_entry(self.tied_names()),
            },
        )

    def _claimed_directory(self, key: str, own: Path) -> Path:
        """The folder the claimant of save ``key`` writes. Workers stopped by SIGTERM reach
        their preemption save at different steps, so each names a different folder, and only
        the claimant's will exist; reporting one's own sent the user to a folder that was
        never written. The claimant posts its folder right after the claim; if it died in
        between, the wait is bounded and this worker's own name is returned."""
        try:
            self.store.wait([f"{key}/directory"], timedelta(seconds=min(self.timeout_s, 30)))
        except Exception:  # the claimant is gone: nothing is written either way
            return own
        return Path(self.store.get(f"{key}/directory").decode())

    def _load(self, directory: Path) -> Checkpoint:
        """Load ``directory`` into the servers (once) and this worker's buffers and RNG."""
        checkpoint = Checkpoint(directory)
        local = set(self.model.state_dict())
        checkpoint.present_names(renaming_for(local))  # compiled or not, one model
        saved = set(checkpoint.names("model"))
        if local - saved or saved - local:
            odd = sorted((local - saved) or (saved - local))
            raise CheckpointError(
                f"{checkpoint.directory} does not match this model ({odd[0]!r} is in one and not "
                "the other): it was saved from a different model."
            )
        first, key = self.claim("load")
        if first:
            try:
                self.link.send_json(Op.LOAD, [{"path": str(directory)}] * self.servers)
            except Exception as error:
                self.store.set(f"{key}/done", f"error: {error}")
                raise
            self.store.set(f"{key}/done", "ok")
        else:
            self.store.wait([f"{key}/done"], timedelta(seconds=self.timeout_s))
            outcome = self.store.get(f"{key}/done").decode()
            if outcome != "ok":
                raise CheckpointError(f"loading {directory} failed on another worker: {outcome}")
        with torch.no_grad():
            for name, tensor in self._model_buffers().items():
                tensor.copy_(checkpoint.tensor("model", name))
        _restore_rng(self, checkpoint)
        self.steps_taken = checkpoint.step
        return checkpoint
