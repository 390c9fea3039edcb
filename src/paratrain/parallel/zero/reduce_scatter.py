"""ZeRO's gradient reducer for the shared step: flat units reduce-scattered into shards.

Each replica keeps only its slice of every unit's reduced gradient (``grads``), and the
optimizer updates only that slice; stages 1-2 then gather the updated slices back into
the full parameters (the engine's ``_after_step``), stage 3 gathers each unit when its
next forward needs it (``gather``), so between its micro-batches the reducer also
releases what stage 3 gathered. The fp16 overflow flag and the clipping norm are sums
over the replicas, since each holds different slices.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch.distributed import ProcessGroup

from paratrain.parallel.clipping import clip_distributed
from paratrain.parallel.loss_reduction import LossTotals
from paratrain.parallel.precision import Precision
from paratrain.parallel.tensor.split import TensorSplit
from paratrain.parallel.zero.gather import ParameterGatherer
from paratrain.parallel.zero.grads import ShardedGradients
from paratrain.parallel.zero.reach import reachable_leaves
from paratrain.parallel.zero.shards import FlatUnit
from paratrain.parallel.zero.unused import ShardPieces
from paratrain.runtime.mesh import Mesh


class ReduceScatterShards:
    """``GradientReducer`` (see ``data_parallel_step``) for sharded model state."""

    def __init__(
        self,
        *,
        grads: ShardedGradients,
        units: list[FlatUnit],
        pieces: ShardPieces,
        gatherer: ParameterGatherer | None,
        group: ProcessGroup | None,
        tensor_split: TensorSplit | None,
        mesh: Mesh | None,
        device: torch.device,
        after_step: Callable[[], None],
    ) -> None:
        self.grads, self.units, self.pieces, self.gatherer = grads, units, pieces, gatherer
        self.group, self.tensor_split, self.mesh = group, tensor_split, mesh
        self.device, self._after_step = device, after_step

    def zero_grad(self) -> None:
        self.grads.zero_grad()

    def begin_micro_batch(self, *, last: bool) -> None:
        self.grads.begin_backward(reduce=last)

    def before_backward(self, scaled: torch.Tensor, totals: LossTotals, *, last: bool) -> None:
        """Stage 3: the parameters this replica's last backward will reach (``reach``)."""
        if self.gatherer is not None and last:
            reachable = reachable_leaves(scaled)
            if reachable is not None:
                self.grads.expect_only(reachable)

    def backward(self, scaled: torch.Tensor) -> None:
        """Stage 3 keeps units gathered through their recompute (see ``gather``)."""
        context = self.gatherer.backward_pass() if self.gatherer is not None else nullcontext()
        with context:
            scaled.backward()

    def after_backward(self) -> None:
        if self.gatherer is not None:
            self.gatherer.release_all()

    def finish(self, totals: LossTotals) -> float:
        mean_loss = self.grads.finish(totals.contribution())
        self.pieces.assign_grads(self.grads.unused)  # parameters no replica used: skipped
        return mean_loss

    def grads_finite(self, precision: Precision, device: torch.device) -> bool:
        """Each rank checks only its slices, so under fp16 the overflow flag is summed
        over the replicas: all skip together or all step; a tensor group's members hold
        different slices too, so with one the vote is the job's."""
        shard_grads = [unit.shard.grad for unit in self.units]
        vote = self.group if self.tensor_split is None else None
        return precision.unscale_and_check(shard_grads, group=vote, device=device)

    def clip(self, max_norm: float) -> float:
        """Each rank holds slices of the flat gradients: their squares add up over the
        replicas. Within a tensor group the parts of a split parameter add up too, while a
        replicated one is held alike by every member and counts once."""
        if self.tensor_split is None:
            held = [unit.shard.grad for unit in self.units if unit.shard.grad is not None]
            return clip_distributed(held, max_norm, device=self.device, group=self.group)
        pieces = [piece for unit in self.units for piece in unit.shard_pieces(unit.shard.grad)]
        split, whole = self.tensor_split.partition(pieces)
        return clip_distributed(
            split, max_norm, device=self.device, shared=whole, shared_by=self.mesh.tensor
        )

    def after_optimizer_step(self) -> None:
        self._after_step()
