"""Bucketed gradient all-reduce, launched during backward so communication overlaps compute.

How it works (the design PyTorch DDP's reducer made standard, kept small here):

- Parameters are grouped, in reverse registration order (roughly the order backward
  produces their gradients), into flat buckets of about ``bucket_bytes``; the first bucket
  is smaller so the first message leaves early.
- Each parameter's ``.grad`` is a view into its bucket's flat buffer, so autograd
  accumulates straight into the message: no copy in, no copy out (DDP's
  ``gradient_as_bucket_view``, which DDP leaves off by default).
- A post-accumulate-grad hook counts down each bucket; a bucket whose gradients are all
  ready is all-reduced asynchronously. Buckets launch strictly in index order, so every
  rank issues the same collectives in the same order even if autograd's order differs.
- The last bucket's hooks launch nothing (they only mark parameters used, see below): it
  can launch only after every other bucket, and it holds the first-registered parameters
  (of the last dtype), whose gradients backward produces last, so ``finish()`` launches
  it when a countdown would have, with the unused count already in its extra slot.
- ``finish()`` launches what backward did not reach and waits. Callers pre-scale the loss
  so that the summed gradient is the mean.
- A few extra float slots ride along in the last bucket: the engine puts the step's loss
  there, so the global mean loss costs no collective of its own.

Unused parameters. The plain loop leaves ``.grad`` None for a parameter that no backward
of the step reached, and the optimizer skips it: no momentum decay, no Adam step, no
weight decay. Here every ``.grad`` is a bucket view, so the reducer keeps torch's rule
itself. Every parameter has a hook (the last bucket's only mark, they launch nothing), so
each replica knows which of its parameters got a gradient in any micro-batch of the step;
the count of those that did not rides in one more extra slot of the last bucket (4 bytes
per step, no message of its own). Where the summed count is not zero, one small
all-reduce of a used flag per parameter follows, and ``finish()`` sets ``.grad = None``
on the parameters no replica used. A parameter used on some replicas and not others
keeps its gradient: the global-batch mean, to which the replicas that did not use it
contributed zeros, which is what one device computes. ``zero_grad()`` puts the views back.

Other engines (pipeline stages replicated over a data-parallel group) reuse this class.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed import ProcessGroup

from paratrain.parallel.options import StrategyOption
from paratrain.runtime import comm

MiB = 1024 * 1024


def _positive_mb(size: float) -> float:
    if not size > 0:
        raise ValueError(f"bucket_mb must be positive, not {size!r}.")
    return size


BUCKET_MB = StrategyOption(
    "bucket_mb", float, 25.0, "all-reduce bucket size in MiB", parse=_positive_mb
)
"""The option every engine that all-reduces gradients in buckets declares."""
_SLOT_DTYPES = (torch.float32, torch.float64)


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    offsets: list[int]
    buffer: torch.Tensor
    extra_slots: int = 0
    pending: int = 0
    handle: object | None = None
    launched: bool = False
    views: list[torch.Tensor] = field(default_factory=list)


def plan_buckets(
    sizes_bytes: list[int], *, bucket_bytes: int, first_bucket_bytes: int
) -> list[list[int]]:
    """Group item indices, in order, into buckets capped at the given byte sizes.

    A single item larger than the cap gets a bucket of its own. Pure, so it is tested
    against exact answers.
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for index, size in enumerate(sizes_bytes):
        cap = first_bucket_bytes if not buckets else bucket_bytes
        if current and filled + size > cap:
            buckets.append(current)
            current, filled = [], 0
        current.append(index)
        filled += size
    if current:
        buckets.append(current)
    return buckets


class BucketedGradientReducer:
    """Sums the gradients of ``params`` over ``group`` in overlapped, bucketed all-reduces."""

    def __init__(
        self,
        params: list[nn.Parameter],
        *,
        group: ProcessGroup | None = None,
        bucket_bytes: int = 25 * MiB,
        first_bucket_bytes: int = 1 * MiB,
        extra_slots: int = 1,
    ) -> None:
        if bucket_bytes <= 0 or first_bucket_bytes <= 0:
            raise ValueError("bucket sizes must be positive; use bucket_mb > 0.")
        self.group = group
        self.extra_slots = extra_slots
        self._slots = extra_slots + 1  # the caller's, then this replica's unused count
        trainable = [p for p in dict.fromkeys(params) if p.requires_grad]
        ordered = list(reversed(trainable))
        self.buckets: list[_Bucket] = []
        for kind in dict.fromkeys((p.dtype, p.device) for p in ordered):
            same = [p for p in ordered if (p.dtype, p.device) == kind]
            plan = plan_buckets(
                [p.numel() * p.element_size() for p in same],
                bucket_bytes=bucket_bytes,
                first_bucket_bytes=first_bucket_bytes,
            )
            self.buckets.extend(self._make_bucket([same[i] for i in idx]) for idx in plan)
        self._extras_bucket = self._place_extra_slots()
        self._bucket_of = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket.params}
        self.params = [p for bucket in self.buckets for p in bucket.params]
        self._index_of = {id(p): i for i, p in enumerate(self.params)}
        self._used = bytearray(len(self.params))
        self._armed = False
        self._next_launch = 0
        self._slot_values: torch.Tensor | None = None
        self._slots_ride_along = False
        for bucket in self.buckets[:-1]:
            for param in bucket.params:
                param.register_post_accumulate_grad_hook(self._on_grad_ready)
        if self.buckets:  # the last bucket launches in finish(): its hooks only mark
            for param in self.buckets[-1].params:
                param.register_post_accumulate_grad_hook(self._mark_used)
        self.attach_grads()

    @staticmethod
    def _make_bucket(params: list[nn.Parameter]) -> _Bucket:
        offsets, total = [], 0
        for param in params:
            offsets.append(total)
            total += param.numel()
        buffer = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
        return _Bucket(params=params, offsets=offsets, buffer=buffer)

    def _place_extra_slots(self) -> _Bucket | None:
        """Widen the last-launched bucket by the extra slots when its dtype can hold a loss."""
        if not self.buckets:
            return None
        last = self.buckets[-1]
        if last.buffer.dtype not in _SLOT_DTYPES:
            return None
        last.buffer = torch.cat([last.buffer, last.buffer.new_zeros(self._slots)])
        last.extra_slots = self._slots
        return last

    @property
    def gradient_bytes(self) -> int:
        """Bytes of gradient this reducer sums per step (extra slots excluded)."""
        return sum(
            (b.buffer.numel() - b.extra_slots) * b.buffer.element_size() for b in self.buckets
        )

    def attach_grads(self) -> None:
        """Point every ``param.grad`` at its slice of the bucket buffer (again, if replaced)."""
        for bucket in self.buckets:
            bucket.views = []
            for param, offset in zip(bucket.params, bucket.offsets, strict=True):
                view = bucket.buffer.narrow(0, offset, param.numel()).view_as(param)
                if param.grad is not None and param.grad.data_ptr() != view.data_ptr():
                    view.copy_(param.grad)
                param.grad = view
                bucket.views.append(view)

    def zero_grad(self) -> None:
        """Zero every gradient with one fill per bucket (and start a step: nothing used yet)."""
        self._used = bytearray(len(self.params))
        for bucket in self.buckets:
            if any(
                p.grad is None or p.grad.data_ptr() != v.data_ptr()
                for p, v in zip(bucket.params, bucket.views, strict=True)
            ):
                self.attach_grads()
                break
        for bucket in self.buckets:
            bucket.buffer.zero_()

    def arm(self, extras: torch.Tensor | None = None) -> None:
        """Make the next backward launch all-reduces; ``extras`` are summed alongside."""
        self._next_launch = 0
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
            bucket.launched = False
            bucket.handle = None
        extras = torch.zeros(0) if extras is None else extras.detach().reshape(-1)
        count = extras.numel()
        if self._extras_bucket is not None and count <= self.extra_slots:
            slots = self._extras_bucket.buffer[-self._slots :]
            self._slots_ride_along = True
        else:  # no float bucket to ride in, or too many extras: a message of their own
            slots = torch.zeros(
                max(count, self.extra_slots) + 1,
                dtype=torch.promote_types(extras.dtype, torch.float32),
                device=self.params[0].device if self.params else extras.device,
            )
            self._slots_ride_along = False
        slots.zero_()
        slots[:count].copy_(extras)
        self._slot_values = slots
        self._armed = True

    def _mark_used(self, param: nn.Parameter) -> None:
        self._used[self._index_of[id(param)]] = 1

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        self._used[self._index_of[id(param)]] = 1
        if not self._armed:
            return
        bucket = self.buckets[self._bucket_of[id(param)]]
        bucket.pending -= 1
        while self._next_launch < len(self.buckets):
            candidate = self.buckets[self._next_launch]
            if candidate.pending > 0:
                break
            self._launch(candidate)

    def _launch(self, bucket: _Bucket) -> None:
        bucket.handle = comm.all_reduce_sum(bucket.buffer, group=self.group, async_op=True)
        bucket.launched = True
        self._next_launch += 1

    def finish(self, extras_count: int = 0) -> torch.Tensor | None:
        """Launch what is left, wait for everything, return the summed extras (if any).

        Parameters that no replica used in this step are left with ``.grad = None``.
        """
        if not self._armed:
            raise RuntimeError(
                "finish() called without arm(); the reducer's steps are out of order."
            )
        slots = self._slot_values
        slots[-1] = self._used.count(0)  # backward is over: this replica's unused count
        while self._next_launch < len(self.buckets):
            self._launch(self.buckets[self._next_launch])
        if not self._slots_ride_along:
            comm.all_reduce_sum(slots, group=self.group)
        for bucket in self.buckets:
            comm.wait(bucket.handle, "gradient all_reduce")
            bucket.handle = None
        self._armed = False
        if slots[-1].item() != 0:
            self._drop_unused_grads()
        self._used = bytearray(len(self.params))
        return slots[:extras_count].clone() if extras_count else None

    def _drop_unused_grads(self) -> None:
        """Agree on which parameters no replica used (one small message) and set their
        ``.grad`` to None, as the plain loop leaves them; ``zero_grad()`` reattaches."""
        used = torch.frombuffer(bytearray(self._used), dtype=torch.uint8)
        used = used.to(device=self.params[0].device, dtype=torch.float32)
        comm.all_reduce_sum(used, group=self.group)
        for index in (used == 0).nonzero().flatten().tolist():
            self.params[index].grad = None
