"""Tensor-parallel state in the common, canonical format: whole tensors out, slices in.

A split parameter's slices are gathered (an all-gather over the tensor group, so every
worker calls) and joined by its ``ShardSpec`` into the tensor the single-device model
has; rank 0 writes (the replicas hold the same state). Loading reads each tensor by name
and keeps this rank's slice. The optimizer state follows its parameter: a value shaped
like the slice (Adam's moments, SGD's momentum buffer) is cut and joined as the
parameter is; anything else (Adam's ``step``) is the same on every rank and passes
whole. So a tp checkpoint loads into ``single``, ``dp`` or any other engine, and theirs
into tp, at any tensor degree that divides the widths.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn

from paratrain.checkpoint import Checkpoint
from paratrain.parallel.checkpointing import ShardedCheckpointState
from paratrain.parallel.optim_state import load_named_optimizer_state, named_optimizer_state
from paratrain.parallel.tp.shards import ShardSpec
from paratrain.runtime import comm


def _elementwise(value: Any, shape: torch.Size, key: str) -> bool:
    """A state value cut with its parameter: shaped like it (``step`` of a 0-d one is not)."""
    return isinstance(value, torch.Tensor) and value.shape == shape and key != "step"


class TensorCheckpointState(ShardedCheckpointState):
    """The checkpoint and state-dict hooks of the tp engine, which holds ``model`` (split
    in place), ``specs`` (``ShardSpec`` by parameter name), ``tensor_rank``,
    ``tensor_group`` and ``optimizer``."""

    model: nn.Module
    specs: dict[str, ShardSpec]
    tensor_rank: int
    tensor_group: Any
    optimizer: torch.optim.Optimizer | None

    def _gathered(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The whole tensor of ``name`` from every rank's slice ``local``, on the CPU."""
        spec = self.specs[name]
        flat = local.detach().contiguous().reshape(-1)
        out = flat.new_empty(flat.numel() * spec.parts)
        comm.all_gather_flat(out, flat, group=self.tensor_group)
        return spec.join([piece.view_as(local) for piece in out.chunk(spec.parts)]).cpu()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The single-device model's state dict, whole (collective: every worker calls)."""
        return {
            name: self._gathered(name, value)
            if name in self.specs
            else value.detach().to("cpu", copy=True)
            for name, value in self.model.state_dict().items()
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Take this rank's slices of a whole state dict."""
        self._load_model(state.__getitem__)

    def _load_model(self, read) -> None:
        aliases = self.tied_names()
        with torch.no_grad():
            for name, tensor in self.model.state_dict().items():
                full = read(aliases.get(name, name))
                spec = self.specs.get(name)
                tensor.copy_(full if spec is None else spec.take(full, self.tensor_rank))

    def gather_checkpoint_state(
        self,
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[dict[str, Any]]]:
        model = self.state_dict()
        writer = self.writes_shard()
        if self.optimizer is None:
            return (model, {}, []) if writer else ({}, {}, [])
        tensors: dict[str, torch.Tensor] = {}
        names = {}
        for name, param in self.model.named_parameters():  # the same order on every rank
            names[id(param)] = name
            state = self.optimizer.state.get(param, {})
            for key in sorted(state):
                value = state[key]
                if name in self.specs and _elementwise(value, param.shape, key):
                    value = self._gathered(name, value)
                elif not isinstance(value, torch.Tensor):
                    value = torch.tensor(value)
                tensors[f"{name}/{key}"] = value.detach().to("cpu", copy=True)
        if not writer:
            return {}, {}, []
        _, groups = named_optimizer_state(self.optimizer, names)
        return model, tensors, groups

    def load_checkpoint_state(self, checkpoint: Checkpoint) -> None:
        self._load_model(lambda name: checkpoint.tensor("model", name))
        optimizer_meta = checkpoint.manifest.get("optimizer")
        if self.optimizer is None or not optimizer_meta:
            return
        aliases = self.tied_names()
        state_keys: dict[str, list[str]] = defaultdict(list)
        for qualified in checkpoint.names("optim"):
            name, _, key = qualified.rpartition("/")
            state_keys[name].append(key)
        params = dict(self.model.named_parameters())
        names = {id(p): aliases.get(name, name) for name, p in params.items()}

        def fetch(qualified: str) -> torch.Tensor:
            name, _, key = qualified.rpartition("/")
            value = checkpoint.tensor("optim", qualified)
            spec = self.specs.get(name)
            if spec is not None and _elementwise(value, spec.full_shape(params[name].shape), key):
                return spec.take(value, self.tensor_rank)
            return value

        load_named_optimizer_state(
            self.optimizer, names, optimizer_meta["param_groups"], state_keys, fetch
        )
