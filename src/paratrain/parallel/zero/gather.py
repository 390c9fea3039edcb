"""Stage 3: each unit's parameters exist in full only while that unit computes.

The units are modules ``units.unit_modules`` chooses: a model's repeated blocks (each
``GPT2Block``), the layers of an ``nn.Sequential`` such as paratrain's models, or what
``units=`` names; each may sit anywhere in the model, called from its parent's forward.
The parameters outside every unit form one more unit, the root, gathered when the model's
forward starts and freed after backward, so the root's parameters may be used anywhere in
between (an embedding, a parameter used between blocks, a head). A unit of several modules
(blocks sharing a Parameter, a head tied to an embedding) has the hooks below on each of
them, and since a unit is freed after backward only once all its gradients are
accumulated, it stays gathered from the backward of its last module to that of its first
(for a tied head, most of backward). A module of a unit may hold another unit's module
(hooks nest: each gathers and frees its own unit).

- Forward: a forward pre-hook all-gathers the unit's parameters; a forward hook frees them
  again and, when autograd will need them, registers a hook on the unit's output tensors.
- Backward: the first of those output hooks fires when the gradient reaching the unit is
  complete, just before autograd enters the unit, and gathers the parameters again (the
  tensors autograd saved are views of the same storage, so they are whole again).
- After backward has accumulated all of a unit's gradients, ``ShardedGradients`` calls
  ``release`` (and, on the last micro-batch, reduce-scatters them).

Activation recompute (``recompute=True``): backward reruns each checkpointed segment's
forward, which fires the unit's hooks again, and then computes with the recomputed saved
tensors, views of the unit's storage. The engine runs backward inside ``backward_pass()``;
there the pre-hook still gathers (a segment's recompute can start before the gradient
reaches the unit's output, when a parameter-free layer after it needs its activations),
but the post-hook frees nothing: a unit gathered for backward stays gathered through its
recompute until ``release`` says its gradients are done. Whichever of the two gathers
comes first does the work and the other finds the unit whole, so each unit is still
gathered once per backward, at a point the graph fixes, identically on every rank.
(The recompute may also stop early, inside the unit, without running its post-hook.)

Every gather blocks until the data is there (bounded by the group timeout); there is no
prefetch of the next unit, which keeps the peak at one gathered unit (plus the root).
Cost per micro-batch: two all-gathers of the model (forward and backward); per step, one
reduce-scatter: 3(N-1)/N x model bytes per rank on a ring, 1.5x data parallel's
all-reduce, as in the ZeRO paper.

Replicas that run different units. Collectives are matched in the order each rank issues
them, and a replica's graph depends on its share of the batch: a unit some replicas call
and others skip (a branch chosen by the data), or a parameter inside a unit that only
some replicas use. Two rules keep every rank's sequence of gathers the same:

- Units are gathered in their fixed order (module order). In forward, a replica that
  reaches unit k first gathers and frees again every unit before k it has not reached
  (the ones it skipped, which the others are gathering now), and at the end of forward
  the rest. In backward, before its next gather, it gathers and frees every unit after
  it that it skipped in forward, where the others gather it for their backward, and at
  the end of backward the rest. A replica that uses every unit, in order, never catches
  up anything: the common path costs nothing more. A model that calls its units in
  another order (a unit called after one that comes later in module order, other than a
  second call of a unit) turns this off for good at that call, on every replica alike,
  and is then exact, as before, only while all replicas run the same units.
- The reduce-scatters run in a process group of their own (``comm.second_group``), in
  one fixed order (``grads``), so they never pair with a gather. A unit this replica
  skipped is reduced as soon as its turn comes (``on_skipped``, zeros from this replica),
  not when the step's reduction ends: a replica that ran it waits for that reduction
  during its backward (at most one message in flight), and its backward's gathers are
  what this replica needs to reach the end.

A parameter that some replicas use and others do not inside a unit they all run (a
per-sample branch inside a block) is found before backward from the autograd graph
(``reach``), so the replica that left it out completes that unit's reduction in turn too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from paratrain.parallel.batching import map_tensors
from paratrain.parallel.zero.shards import FlatUnit
from paratrain.runtime.untraced import untraced


class ParameterGatherer:
    """Installs the gather/free hooks of stage 3 on the unit modules and the root."""

    def __init__(
        self,
        model: nn.Module,
        modules: list[list[nn.Module]],
        units: list[FlatUnit],
        root: FlatUnit | None,
        *,
        group: ProcessGroup | None,
    ) -> None:
        self.group = group
        self.units = units
        self.root = root
        self._needs_backward_gather: dict[int, bool] = {}
        self._in_backward = False
        self._cursor = 0
        """Forward: every unit before it was gathered (run or caught up) in this pass."""
        self._ran: set[int] = set()
        self._skipped: list[int] = []
        """Backward: units this replica skipped in forward, highest index first."""
        self._in_order = True
        """Whether every forward so far called the units in module order (see above)."""
        self.on_skipped: Callable[[list[int]], None] | None = None
        """Called at the end of a forward with grad with the units it skipped (``grads``)."""
        # untraced: in a model compiled whole, dynamo would trace the hooks to each
        # gather and recompile every step on the state they read (``runtime/untraced``)
        for index, (unit_children, _unit) in enumerate(zip(modules, units, strict=True)):
            for module in unit_children:
                module.register_forward_pre_hook(untraced(self._pre_forward(index)))
                module.register_forward_hook(untraced(self._post_forward(index)))
        model.register_forward_pre_hook(untraced(lambda _module, _args: self.begin_forward()))
        model.register_forward_hook(untraced(lambda _module, _args, _output: self.end_forward()))

    def begin_forward(self) -> None:
        """A forward starts: gather the root, reset the cursor (``model(...)``'s pre-hook)."""
        self._cursor, self._ran, self._skipped = 0, set(), []
        if self.root is not None:
            self.root.gather(self.group)

    def end_forward(self) -> None:
        """A forward ended: catch up the units after the last one run (``model(...)``'s
        hook); remember which units this replica skipped, for backward."""
        if not self._in_order:
            return
        self._catch_up(range(self._cursor, len(self.units)))
        self._cursor = len(self.units)
        self._skipped = [i for i in reversed(range(len(self.units))) if i not in self._ran]
        if self._skipped and self.on_skipped is not None and torch.is_grad_enabled():
            self.on_skipped(self._skipped)

    def _catch_up(self, indices) -> None:
        """Gather and free units this replica does not run, where the others gather them."""
        for index in indices:
            unit = self.units[index]
            if not unit.gathered:
                unit.gather(self.group)
                unit.release()

    def _gather_for_backward(self, index: int) -> None:
        """Before unit ``index``'s backward gather: the skipped units after it first."""
        while self._skipped and self._skipped[0] > index:
            self._catch_up([self._skipped.pop(0)])
        self.units[index].gather(self.group)

    def _pre_forward(self, index: int):
        def hook(_module: nn.Module, _args: Any) -> None:
            if self._in_backward:  # a recompute
                self._gather_for_backward(index)
                return
            if index < self._cursor and index not in self._ran:
                self._in_order = False  # out of module order: no more catching up
            if self._in_order and index >= self._cursor:
                self._catch_up(range(self._cursor, index))
                self._cursor = index + 1
            self._ran.add(index)
            self.units[index].gather(self.group)

        return hook

    def _post_forward(self, index: int):
        unit = self.units[index]

        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            if self._in_backward:
                return  # a recompute: backward still needs the unit; ``release`` frees it
            unit.release()
            if not torch.is_grad_enabled():
                return
            self._needs_backward_gather[id(unit)] = True

            def before_backward(grad: torch.Tensor) -> None:
                if self._needs_backward_gather.pop(id(unit), False):
                    self._gather_for_backward(index)

            def register(tensor: torch.Tensor) -> torch.Tensor:
                if tensor.requires_grad:
                    tensor.register_hook(before_backward)
                return tensor

            map_tensors(output, register)

        return hook

    @contextmanager
    def backward_pass(self) -> Iterator[None]:
        """Run a backward inside: forwards recomputed there keep their unit gathered."""
        self._in_backward = True
        try:
            yield
        finally:
            self._in_backward = False
        self._catch_up(self._skipped)  # the skipped units the others gather last
        self._skipped = []

    def release(self, unit: FlatUnit) -> None:
        """A unit's backward is over (all its gradients are accumulated)."""
        if unit is not self.root:
            unit.release()

    def release_all(self) -> None:
        """After a backward or a no-grad forward: free whatever is still gathered."""
        self._needs_backward_gather.clear()
        self._skipped = []
        for unit in self.units:
            unit.release()
        if self.root is not None:
            self.root.release()
