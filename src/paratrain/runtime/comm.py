"""Collectives that count the bytes they move.

Every engine talks to its peers through these functions rather than through
``torch.distributed`` directly, so that the bytes each worker hands to the network can be
reported per step (and compared with the ring optimum in the benchmarks) and so that
timeouts and error reporting live in one place. The process group's own timeout (set by
``launch``) bounds every operation: no collective waits forever.
"""

from __future__ import annotations

import pickle
from collections import Counter
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from paratrain.runtime.devices import on_cuda
from paratrain.runtime.hang import collective

_bytes_by_op: Counter[str] = Counter()


def distributed() -> bool:
    """Whether this process is part of a process group (launched, or under torchrun)."""
    return dist.is_available() and dist.is_initialized()


def world_size(group: ProcessGroup | None = None) -> int:
    """Members of ``group``; 1 where no process group exists (a plain single process)."""
    if not distributed():
        return 1
    return dist.get_world_size(group)


def rank(group: ProcessGroup | None = None) -> int:
    """This worker's rank within ``group``; 0 where no process group exists."""
    if not distributed():
        return 0
    return dist.get_rank(group)


def bytes_sent() -> int:
    """Total payload bytes this worker has handed to collectives so far."""
    return sum(_bytes_by_op.values())


def bytes_by_operation() -> dict[str, int]:
    """Payload bytes per collective kind, for reports."""
    return dict(_bytes_by_op)


def _count(op: str, tensor: torch.Tensor) -> None:
    _bytes_by_op[op] += tensor.numel() * tensor.element_size()


def all_reduce_sum(
    tensor: torch.Tensor, *, group: ProcessGroup | None = None, async_op: bool = False
):
    """In-place sum over ``group``. Gloo has no AVG, so callers pre-scale for a mean."""
    _count("all_reduce", tensor)
    if async_op:
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
    with collective("all_reduce"):
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)


def all_reduce_max(tensor: torch.Tensor, *, group: ProcessGroup | None = None) -> None:
    """In-place elementwise maximum over ``group`` (a vocabulary-split softmax's max)."""
    _count("all_reduce", tensor)
    with collective("all_reduce"):
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)


def all_gather_flat(
    output: torch.Tensor,
    shard: torch.Tensor,
    *,
    group: ProcessGroup | None = None,
    async_op: bool = False,
):
    """Concatenate every rank's equal-sized ``shard`` into ``output`` (rank order).

    Counts the shard, the payload this worker hands over. ``shard`` must not alias
    ``output``. Gloo supports it natively in the torch versions we test (2.13).
    """
    _count("all_gather", shard)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    if async_op:
        return gather(output, shard, group=group, async_op=True)
    with collective("all_gather"):
        return gather(output, shard, group=group)


def reduce_scatter_sum(
    output: torch.Tensor,
    flat: torch.Tensor,
    *,
    group: ProcessGroup | None = None,
    async_op: bool = False,
):
    """Sum ``flat`` over ``group`` and leave this rank's 1/N slice of it in ``output``.

    Counts ``flat``, the payload this worker hands over (as ``all_reduce_sum`` does).
    """
    _count("reduce_scatter", flat)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    if async_op:
        return scatter(output, flat, op=dist.ReduceOp.SUM, group=group, async_op=True)
    with collective("reduce_scatter"):
        return scatter(output, flat, op=dist.ReduceOp.SUM, group=group)


def all_gather_objects(value: object, *, group: ProcessGroup | None = None) -> list[object]:
    """Every rank's picklable ``value``, in rank order. For small metadata only (what a
    checkpoint needs to know about other ranks' state), never for tensors of a step."""
    _bytes_by_op["all_gather_object"] += len(pickle.dumps(value))
    gathered: list[object] = [None] * world_size(group)
    with collective("all_gather_object"):
        dist.all_gather_object(gathered, value, group=group)
    return gathered


def wait(work, op: str) -> None:
    """Wait for an asynchronous operation; a timeout names the ranks that did not arrive."""
    with collective(op):
        work.wait()


def barrier(op: str = "barrier") -> None:
    """A barrier whose timeout names the ranks that did not arrive."""
    with collective(op):
        dist.barrier()


def broadcast_tensors(
    tensors: Iterable[torch.Tensor], *, src: int = 0, group: ProcessGroup | None = None
) -> None:
    """Make ``tensors`` equal to ``src``'s copies, one flat message per dtype and device."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        by_kind.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    global_src = src if group is None else dist.get_global_rank(group, src)
    for same_kind in by_kind.values():
        flat = torch.cat([t.detach().reshape(-1) for t in same_kind])
        _count("broadcast", flat)
        with collective("broadcast"):
            dist.broadcast(flat, src=global_src, group=group)
        offset = 0
        for tensor in same_kind:
            n = tensor.numel()
            with torch.no_grad():
                tensor.copy_(flat[offset : offset + n].view_as(tensor))
            offset += n


def send_async(tensor: torch.Tensor, *, dst: int, tag: int = 0, via=None):
    """Non-blocking point-to-point send; the caller keeps ``tensor`` alive until ``wait()``.

    Sends never block, so a schedule in which every receive's matching send is eventually
    issued cannot deadlock, whatever order the two neighbours post their operations in.
    ``via``: another transport with ``isend`` (``local_p2p``'s shared memory), else gloo's.
    """
    _count("send", tensor)
    if via is not None:
        return via.isend(tensor, dst, tag)
    return dist.isend(tensor, dst=dst, tag=tag)


def group_timeout_s(group: ProcessGroup | None = None) -> float:
    """The timeout the process group was made with (what bounds its every wait), for
    waits of our own that should give up when its collectives would."""
    pg = group or dist.distributed_c10d._get_default_group()
    try:
        return pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return dist.default_pg_timeout.total_seconds()


def second_group(group: ProcessGroup | None = None) -> ProcessGroup:
    """A new process group over ``group``'s ranks (the whole job by default), with its
    timeout: collectives are matched in issue order within a group, so two streams of
    collectives whose interleaving may differ between ranks (zero3's parameter gathers and
    its gradient reduce-scatters) stay matched when each has its own group. Every member
    calls it at the same points; other ranks need not (local synchronisation). One per set
    of ranks, kept for the process (engines built one after another share it)."""
    group = group or dist.group.WORLD
    ranks = tuple(dist.get_process_group_ranks(group))
    key = (id(dist.group.WORLD), ranks)  # a new job (init after destroy) gets new groups
    if key in _second_groups:
        return _second_groups[key]
    device = torch.device("cuda" if on_cuda(group) else "cpu")
    try:
        timeout = group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):  # not exposed: torch's default
        timeout = None
    second = dist.new_group(ranks=list(ranks), timeout=timeout, use_local_synchronization=True)
    _second_groups[key] = second
    return second


_second_groups: dict[tuple[int, tuple[int, ...]], ProcessGroup] = {}
