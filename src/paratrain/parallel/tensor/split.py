"""One worker's part of the tensor dimension: which parameters it holds slices of, and how
the canonical (whole) tensors are rebuilt from the slices and cut back into them.

An engine that splits layers (dp and its ``tp`` default, zero1/2, the pipeline) applies a
checked plan to its model (``split_model``) and keeps the returned ``TensorSplit`` as
``engine.tensor_split``; the engine-neutral code then composes with it:

- checkpoints (``parallel/checkpointing.py``): the writer's model and optimizer tensors
  are joined over the tensor group (``whole_state``, ``whole_optimizer``) and written by
  tensor rank 0 alone; loading cuts each saved tensor to the slice this worker holds
  (``local``, ``local_optimizer``, or ``sliced`` for an engine reading the checkpoint
  itself), so a checkpoint is the single-device model's, whatever the layout;
- clipping: a split parameter's slices add their squares over the tensor group, a
  replicated one is whole (and equal) on each member and counts once.

Optimizer state follows its parameter: a value shaped like the slice (Adam's moments,
SGD's momentum) is elementwise, cut and joined as the parameter is; anything else (Adam's
``step``) is the same on every member and passes whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from paratrain.parallel.tensor import hf_plan, setup_check
from paratrain.parallel.tensor.apply import apply_plan
from paratrain.parallel.tensor.plan import TensorPlan, resolve_plan
from paratrain.parallel.tensor.rng import share_stream
from paratrain.parallel.tensor.shards import ShardSpec
from paratrain.runtime import comm
from paratrain.runtime.mesh import Mesh


@dataclass
class TensorSplit:
    """The split this worker holds: ``degree`` slices per split parameter, this worker's
    ``rank`` of them, the ``group`` that holds the others, and each split parameter's
    ``ShardSpec`` and local shape under its canonical name."""

    degree: int
    rank: int
    group: ProcessGroup | None
    plan: TensorPlan
    specs: dict[str, ShardSpec]
    local_shapes: dict[str, torch.Size]
    whole_plan: TensorPlan
    """The plan over the whole model (``plan`` is this worker's part of it: a stage's)."""

    def is_split(self, name: str) -> bool:
        return name in self.specs

    # -- whole tensors from slices (collective over the tensor group) ----------------------

    def whole(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The whole tensor of ``name`` from every member's slice ``local``, on the CPU.
        Every member calls it for the same names in the same order."""
        spec = self.specs[name]
        flat = local.detach().contiguous().reshape(-1)
        out = flat.new_empty(flat.numel() * spec.parts)
        comm.all_gather_flat(out, flat, group=self.group)
        return spec.join([piece.view_as(local) for piece in out.chunk(spec.parts)]).cpu()

    def joined(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """``local`` made whole where ``name`` is split (collective, as ``whole``); else
        ``local`` itself."""
        return self.whole(name, local) if name in self.specs else local

    def whole_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state`` (canonical names, this worker's slices) with every split tensor whole;
        the others are copied to the CPU as they are."""
        return {
            name: self.whole(name, value)
            if name in self.specs
            else value.detach().to("cpu", copy=True)
            for name, value in state.items()
        }

    def _elementwise(self, qualified: str, shape: torch.Size, *, full: bool) -> str | None:
        """The parameter name of optimizer value ``qualified`` ("name/key") if it is cut
        with its split parameter (shaped like the slice, or like the whole where ``full``)."""
        name, _, key = qualified.rpartition("/")
        if name not in self.specs or key == "step":  # a 0-d parameter's step looks alike
            return None
        local = self.local_shapes[name]
        expected = self.specs[name].full_shape(local) if full else local
        return name if shape == expected else None

    def whole_optimizer(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Optimizer tensors by "name/key", the elementwise values of split parameters
        made whole. Every member calls it with the same keys (sorted here, so that the
        members' gathers pair up whatever order each built its dict in)."""
        out = {}
        for qualified in sorted(tensors):
            value = tensors[qualified]
            name = self._elementwise(qualified, value.shape, full=False)
            out[qualified] = (
                self.whole(name, value) if name else value.detach().to("cpu", copy=True)
            )
        return out

    # -- slices from whole tensors ---------------------------------------------------------

    def local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This worker's slice of the whole tensor ``name`` (``full`` itself if not split)."""
        spec = self.specs.get(name)
        return full if spec is None else spec.take(full, self.rank)

    def local_optimizer(self, qualified: str, value: torch.Tensor) -> torch.Tensor:
        """This worker's slice of a saved optimizer value ("name/key")."""
        name = self._elementwise(qualified, value.shape, full=True)
        return value if name is None else self.specs[name].take(value, self.rank)

    def local_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A whole canonical state dict cut to this worker's slices."""
        return {name: self.local(name, value) for name, value in state.items()}

    def sliced(self, checkpoint: Any) -> SlicedCheckpoint:
        """``checkpoint`` as this worker sees it: every tensor read is its slice."""
        return SlicedCheckpoint(checkpoint, self)

    # -- norms -----------------------------------------------------------------------------

    def partition(
        self, named: list[tuple[str, torch.Tensor]]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(slices of split parameters, whole replicated tensors) of ``named``."""
        split = [t for name, t in named if name in self.specs]
        whole = [t for name, t in named if name not in self.specs]
        return split, whole

    def describe(self) -> str:
        return self.whole_plan.describe()

    def share_stream(self, device: torch.device) -> None:
        """One random stream for the group (``rng``): call it once every worker has its
        own (``replica_rng``), and after loading a checkpoint's streams."""
        share_stream(device, group=self.group)


class SlicedCheckpoint:
    """A ``Checkpoint`` whose ``tensor(kind, name)`` returns this worker's slice, for an
    engine that reads a checkpoint itself (ZeRO cuts its flat shards from what it reads)."""

    def __init__(self, checkpoint: Any, split: TensorSplit) -> None:
        self._checkpoint = checkpoint
        self._split = split

    def tensor(self, kind: str, name: str) -> torch.Tensor:
        value = self._checkpoint.tensor(kind, name)
        if kind == "optim":
            return self._split.local_optimizer(name, value)
        return self._split.local(name, value) if kind == "model" else value

    def tensors(self, kind: str, names: list[str] | None = None):
        for name in self._checkpoint.names(kind) if names is None else names:
            yield name, self.tensor(kind, name)

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._checkpoint, attribute)


def split_model(
    model: nn.Module,
    mesh: Mesh,
    *,
    tp_plan: dict[str, str] | str | None,
    only: set[str] | None = None,
) -> TensorSplit:
    """Split ``model``'s planned layers in place and return this worker's ``TensorSplit``.

    Every member's model must be equal before (each cuts its slices from the same whole).
    The engine then gives the members one random stream (``TensorSplit.share_stream``), so
    that replicated activations, dropout included, are computed alike on each. ``only``
    (module names) limits the split to the modules this worker keeps, a pipeline stage's;
    the plan is still checked on the whole model, so every stage agrees on it. The
    degree, this worker's rank and its group are ``mesh``'s tensor dimension. An
    attention that keeps a forward we did not write is checked against its whole self
    at its first call (``setup_check``).
    """
    tensor, rank, group = mesh.tensor, mesh.tensor_rank, mesh.tensor_group
    whole_plan = resolve_plan(model, tensor, tp_plan)
    if tp_plan == hf_plan.AUTO and comm.rank() == 0:
        print(hf_plan.applied_line(model, tensor), flush=True)
    plan = whole_plan if only is None else whole_plan.restricted_to(only)
    wholes = setup_check.keep_wholes(model, plan.attention)
    specs = apply_plan(model, plan, rank=rank, tensor=tensor, group=group)
    params = dict(model.named_parameters(remove_duplicate=False))  # a tied head's name too
    shapes = {name: params[name].shape for name in specs}
    split = TensorSplit(tensor, rank, group, plan, specs, shapes, whole_plan)
    setup_check.arm(model, wholes, split.joined)
    return split
