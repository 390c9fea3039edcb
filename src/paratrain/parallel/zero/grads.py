"""Gradients reduce-scattered unit by unit during backward, so each rank keeps only its slice.

The flat-shard counterpart of ``grad_buckets``: a post-accumulate-grad hook counts down
each unit's parameters; when a unit's gradients are all final (on the last micro-batch of
a step) its flat gradient is reduce-scattered asynchronously, which sums it over the ranks
and leaves each rank the slice its optimizer shard needs. Units launch strictly in the
given order, so every rank issues the same collectives in the same order.

Two ways of holding gradients (``keep_full``):

- Stage 1 keeps a persistent full flat gradient buffer per unit; every ``param.grad`` is a
  view into it (autograd accumulates straight into the message) and the shard's gradient
  is a view of this rank's slice, filled from the reduce-scatter. Gradient memory: the
  whole model (4 bytes per fp32 parameter), as ZeRO stage 1 specifies.
- Stages 2-3 let autograd allocate ``param.grad``; when a unit is final its gradients are
  copied into one flat message and dropped, and only the reduced slice (1/N) is kept. At
  most one earlier message stays in flight, so the full gradients of the model never all
  exist at once when there is one micro-batch. With ``gradient_accumulation=k > 1`` the
  unsharded gradients are held across the k micro-batches (one reduction per step, as
  the engine contract asks) and freed when the step's reduction is done.

The step's loss rides in a 2-element all-reduce launched behind the last reduce-scatter;
the other element is the number of this rank's parameters that got no gradient in any
micro-batch of the step (the hooks mark the ones that did). Where the sum is not zero, one
more small all-reduce of a used flag per parameter says which parameters no replica used:
``unused`` lists them per unit, for the optimizer to skip as torch skips a parameter whose
``.grad`` is None (``unused.py``). A parameter some replicas used keeps its reduced
gradient, the global-batch mean to which the others contributed zeros.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed import ProcessGroup

from paratrain.parallel.zero.shards import FlatUnit
from paratrain.runtime import comm


class ShardedGradients:
    """Sums every unit's gradient over ``group``, leaving this rank's slice on ``unit.shard``.

    ``order`` is the launch order (roughly the order backward finishes the units);
    ``on_unit_done(unit)`` is called after every backward in which all of a unit's
    gradients were accumulated (stage 3 frees the unit's parameters there).
    """

    def __init__(
        self,
        units: list[FlatUnit],
        *,
        order: list[int],
        group: ProcessGroup | None,
        keep_full: bool,
        on_unit_done: Callable[[FlatUnit], None] | None = None,
    ) -> None:
        self.units = units
        self.order = order
        self.group = group
        self.keep_full = keep_full
        self.on_unit_done = on_unit_done
        self._position = {index: place for place, index in enumerate(order)}
        self._unit_of = {id(p): i for i, unit in enumerate(units) for p in unit.params}
        self._flag_of = {id(p): f for f, p in enumerate(p for u in units for p in u.params)}
        self._used = bytearray(len(self._flag_of))
        self.unused: list[list[int]] | None = None
        """After ``finish``: per unit, the indices of its parameters no replica used in this
        step, or None where every parameter was used (the common case)."""
        self._pending = [0] * len(units)
        self._reduce = False
        self._next = 0
        self._in_flight: list[tuple[int, object, torch.Tensor, torch.Tensor]] = []
        self._loss: tuple[object, torch.Tensor] | None = None
        self.full_grads: list[torch.Tensor] = []
        if keep_full:
            self.full_grads = [unit.full.new_zeros(unit.padded_numel) for unit in units]
            for unit, flat in zip(units, self.full_grads, strict=True):
                unit.shard.grad = unit.my_slice(flat)
        for unit in units:
            for param in unit.params:
                param.register_post_accumulate_grad_hook(self._on_grad_ready)

    def zero_grad(self) -> None:
        """Start a step: zero stage 1's buffers, drop stage 2-3's slices."""
        self._used = bytearray(len(self._flag_of))
        for index, unit in enumerate(self.units):
            if self.keep_full:
                flat = self.full_grads[index]
                flat.zero_()
                for param, view in zip(unit.params, unit.param_views(flat), strict=True):
                    param.grad = view
                unit.shard.grad = unit.my_slice(flat)
            else:
                for param in unit.params:
                    param.grad = None
                unit.shard.grad = None

    def begin_backward(self, *, reduce: bool) -> None:
        """Arm the hooks for one backward; ``reduce`` on the step's last micro-batch."""
        self._pending = [len(unit.params) for unit in self.units]
        self._reduce = reduce
        self._next = 0

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        self._used[self._flag_of[id(param)]] = 1
        index = self._unit_of[id(param)]
        self._pending[index] -= 1
        if self._pending[index]:
            return
        if self.on_unit_done is not None:
            self.on_unit_done(self.units[index])
        self._launch_ready()

    def skipped(self, indices: list[int]) -> None:
        """Units this replica's forward did not run (zero3, ``gather``): no gradient of
        theirs will come in this backward, so each is reduced (zeros from this replica)
        as soon as its turn comes, not when the step's reduction ends: a replica that ran
        it waits for it during its backward, and this one must not make it wait for the
        end of a backward whose gathers need that replica."""
        for index in indices:
            self._pending[index] = 0
        self._launch_ready()

    def expect_only(self, reachable: set[int]) -> None:
        """Before a reducing backward: parameters outside ``reachable`` (ids) get no
        gradient in it, so their units complete without them (``reach`` says why). A
        unit none of whose parameters is reachable is left to ``skipped`` or ``finish``."""
        for index, unit in enumerate(self.units):
            missing = sum(1 for param in unit.params if id(param) not in reachable)
            if missing and missing < len(unit.params):
                self._pending[index] -= missing

    def _launch_ready(self) -> None:
        if not self._reduce:
            return
        while self._next < len(self.order) and self._pending[self.order[self._next]] == 0:
            self._launch(self.order[self._next])

    def _launch(self, index: int) -> None:
        unit = self.units[index]
        if self.keep_full:
            flat = self.full_grads[index]
        else:
            self._wait_in_flight()  # at most one earlier message alive: bounded memory
            flat = unit.flatten([param.grad for param in unit.params])
            for param in unit.params:
                param.grad = None
        out = flat.new_empty(unit.shard_numel)
        handle = comm.reduce_scatter_sum(out, flat, group=self.group, async_op=True)
        self._in_flight.append((index, handle, flat, out))
        self._next += 1

    def _wait_in_flight(self) -> None:
        for index, handle, _flat, out in self._in_flight:
            comm.wait(handle, "gradient reduce_scatter")
            unit = self.units[index]
            if self.keep_full:
                unit.my_slice(self.full_grads[index]).copy_(out)
            else:
                unit.shard.grad = out
        self._in_flight = []

    def finish(self, loss_share: torch.Tensor) -> float:
        """Launch what backward did not reach, wait for all, return the summed loss share.

        Parameters that got no gradient on a rank contribute zeros there; ``unused`` says
        which ones no rank used.
        """
        if not self._reduce:
            raise RuntimeError("finish() called without begin_backward(reduce=True).")
        while self._next < len(self.order):
            self._launch(self.order[self._next])
        loss = torch.stack([loss_share.detach().reshape(()), loss_share.new_tensor(0.0)])
        loss[1] = self._used.count(0)
        handle = comm.all_reduce_sum(loss, group=self.group, async_op=True)
        self._wait_in_flight()
        comm.wait(handle, "loss all_reduce")
        self._reduce = False
        self.unused = self._agree_on_unused() if loss[1].item() != 0 else None
        self._used = bytearray(len(self._flag_of))
        return float(loss[0])

    def _agree_on_unused(self) -> list[list[int]]:
        """Sum the used flags over the replicas (one small all-reduce); per unit, the
        indices of the parameters whose sum is zero."""
        used = torch.frombuffer(bytearray(self._used), dtype=torch.uint8)
        used = used.to(device=self.units[0].full.device, dtype=torch.float32)
        comm.all_reduce_sum(used, group=self.group)
        unused, start = [], 0
        for unit in self.units:
            flags = used[start : start + len(unit.params)]
            unused.append((flags == 0).nonzero().flatten().tolist())
            start += len(unit.params)
        return unused
