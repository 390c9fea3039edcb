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
prefetch of the next unit, which keeps the peak at one gathered unit (plus the root) and
the order of collectives identical on every rank: all ranks run the same graph, so the
hooks fire in the same order. Cost per micro-batch: two all-gathers of the model (forward
and backward); per step, one reduce-scatter: 3(N-1)/N x model bytes per rank on a ring,
1.5x data parallel's all-reduce, as in the ZeRO paper.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from paratrain.parallel.batching import map_tensors
from paratrain.parallel.zero.shards import FlatUnit


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
        for unit_children, unit in zip(modules, units, strict=True):
            for module in unit_children:
                module.register_forward_pre_hook(self._pre_forward(unit))
                module.register_forward_hook(self._post_forward(unit))
        if root is not None:
            model.register_forward_pre_hook(lambda _module, _args: root.gather(self.group))

    def _pre_forward(self, unit: FlatUnit):
        def hook(_module: nn.Module, _args: Any) -> None:
            unit.gather(self.group)

        return hook

    def _post_forward(self, unit: FlatUnit):
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            if self._in_backward:
                return  # a recompute: backward still needs the unit; ``release`` frees it
            unit.release()
            if not torch.is_grad_enabled():
                return
            self._needs_backward_gather[id(unit)] = True

            def before_backward(grad: torch.Tensor) -> None:
                if self._needs_backward_gather.pop(id(unit), False):
                    unit.gather(self.group)

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

    def gather_root(self) -> None:
        """Gather the root unit (the model's pre-hook does it when ``model(...)`` is called)."""
        if self.root is not None:
            self.root.gather(self.group)

    def release(self, unit: FlatUnit) -> None:
        """A unit's backward is over (all its gradients are accumulated)."""
        if unit is not self.root:
            unit.release()

    def release_all(self) -> None:
        """After a backward or a no-grad forward: free whatever is still gathered."""
        self._needs_backward_gather.clear()
        for unit in self.units:
            unit.release()
        if self.root is not None:
            self.root.release()
