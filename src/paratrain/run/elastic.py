"""Elastic data parallel in the worker: a peer dies, the survivors go on without a lost step.

Why this is exact: dp's global batch does not depend on the worker count (the same batch
split over fewer replicas gives the same update, up to the order in which the shares'
gradients are summed), and every replica holds the whole model and optimizer state. So
when a peer dies in step ``k``, the survivors form a new group (``runtime/elastic``),
rebuild the engine over it, take the state of the survivor that got furthest (a peer may
have finished step ``k`` if the dead one died after its last all-reduce) and, if nobody
finished it, redo step ``k`` on the same global batch split over themselves. No
checkpoint is read; at most the step in flight is redone.

A worker whose own step raises (not a collective failing) prints its traceback and exits
without a result: to the launcher that is one more death, and the others go on.

Growing back is exact for the same reason: a replacement (``--max-restarts``) joins at a
step boundary, receives the furthest member's state (model, optimizer, step count, both
loaders' positions) and takes its share of the next global batch.
"""

from __future__ import annotations

import io
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from paratrain.runtime import comm
from paratrain.runtime.elastic import (
    ElasticShortfall,
    ElasticTerms,
    Generation,
    Post,
    admit,
    announce_ready,
    await_admission,
    await_members,
    elastic_terms,
    gather,
    is_communication_error,
    is_ready,
    leave_group,
    mark_elastic,
    next_generation,
    read_post,
    reform,
    store_client,
)


@dataclass
class ElasticWorker:
    """This worker's place in an elastic job: its launch rank and the current generation."""

    launch_rank: int
    min_devices: int
    backend: str
    timeout_s: float
    generation: Generation
    store: Any = field(repr=False)
    late: bool = False
    """Whether this worker joined a running job (it receives the state, see ``replace``)."""

    @classmethod
    def join(
        cls, launch_rank: int, min_devices: int, replacements: int, timeout_s: float
    ) -> ElasticWorker:
        """Mark the job elastic on the launcher's store; generation 0 is everyone."""
        store = store_client(timeout_s)
        backend = dist.get_backend()
        mark_elastic(store, ElasticTerms(min_devices, replacements, backend))
        members = tuple(range(comm.world_size()))
        generation = Generation(0, members, min_devices)
        return cls(launch_rank, min_devices, backend, timeout_s, generation, store)

    @classmethod
    def replace(cls, launch_rank: int, min_devices: int, timeout_s: float) -> ElasticWorker:
        """In a replacement: say it is ready, wait to be admitted (as long as the run may
        take: ``timeout_s`` per step would not bound it, so it waits until the launcher
        stops it), then form the group with the others."""
        store = store_client(timeout_s)
        terms = elastic_terms(store)
        announce_ready(store, launch_rank)
        number = await_admission(store, launch_rank, timeout_s=7 * 24 * 3600.0)
        post = read_post(store, number)
        generation = generation_to_join(store, number, post, launch_rank, min_devices, timeout_s)
        reform(store, generation, launch_rank, terms.backend, timeout_s)
        return cls(launch_rank, min_devices, terms.backend, timeout_s, generation, store, True)


@dataclass(frozen=True)
class Change:
    """One change of worker count, as recorded."""

    step: int
    old: int
    new: int
    lost: tuple[int, ...]
    seconds_lost: float
    steps_redone: int
    joined: tuple[int, ...] = ()

    def record(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "old_workers": self.old,
            "new_workers": self.new,
            "lost_ranks": list(self.lost),
            "joined_ranks": list(self.joined),
            "seconds_lost": round(self.seconds_lost, 3),
            "steps_redone": self.steps_redone,
        }

    def line(self) -> str:
        redone = f"step {self.step} redone" if self.steps_redone else "no step redone"
        what = []
        if self.lost:
            what.append(f"worker {_ranks(self.lost)} lost in step {self.step}")
        if self.joined:
            what.append(f"worker {_ranks(self.joined)} joined after step {self.step}")
        counts = (
            f"{self.new} of {self.old} workers go on"
            if self.new <= self.old
            else f"{self.new} workers go on ({self.old} before)"
        )
        return f"paratrain: {'; '.join(what)}; {counts} ({redone}, {self.seconds_lost:.2f} s lost)."


def _ranks(ranks: tuple[int, ...]) -> str:
    return ", ".join(str(r) for r in ranks)


def attempt_step(body: Callable[[], Any], elastic: ElasticWorker) -> tuple[bool, Any]:
    """Run ``body`` (the step, its log, the stop vote); returns (True, its value), or
    (False, the next generation's ``Post``) where a peer died during it. A collective that
    failed with nobody dead is raised as it was; this worker's own error ends it (see the
    module docstring). The traceback is dropped before returning: it holds the engine,
    and through it the old group, whose sockets must close for the others to notice."""
    try:
        return True, body()
    except Exception as error:  # noqa: BLE001 - sorted below: a peer's death or our own fault
        if not is_communication_error(error):
            _exit_as_lost()
        post = await_members(elastic.store, elastic.generation.number + 1)
        if post is None:
            raise
    return False, post


def _exit_as_lost() -> None:
    """This worker's own step failed: say why, and leave as a dead worker would."""
    traceback.print_exc(file=sys.stderr)
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(1)


def admissions(elastic: ElasticWorker) -> Post | None:
    """At a step boundary, while replacements are announced: whether any is ready, agreed
    by the whole group (each member's look at the store, all-reduced: members may look at
    different moments), and if so the generation that admits them (the lead posts it)."""
    coming = elastic.generation.joining
    if not coming:
        return None
    ready = torch.tensor([float(is_ready(elastic.store, r)) for r in coming])
    dist.all_reduce(ready, op=dist.ReduceOp.MAX)
    newcomers = [r for r, flag in zip(coming, ready.tolist(), strict=True) if flag]
    if not newcomers:
        return None
    members = tuple(sorted({*elastic.generation.members, *newcomers}))
    post = Post(members, tuple(r for r in coming if r not in newcomers))
    number = elastic.generation.number + 1
    if comm.rank() == 0:
        taken = next_generation(elastic.store)
        if taken != number:
            raise RuntimeError(
                f"generation {number} was taken while replacement(s) "
                f"{_ranks(tuple(newcomers))} were being admitted (a worker died meanwhile)."
            )
        admit(elastic.store, number, post, newcomers)
        return post
    return await_members(elastic.store, number, wait_s=elastic.timeout_s)


def hold_for_admission(elastic: ElasticWorker, wait_s: float) -> None:
    """A drill's ``hold``: wait until a replacement is ready to join (so that the test
    knows at which boundary it joins, whatever the machine's load)."""
    deadline = time.monotonic() + wait_s
    coming = elastic.generation.joining  # none: every replacement has joined already
    while coming and not any(is_ready(elastic.store, r) for r in coming):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no replacement was ready to join within {wait_s:.0f} s.")
        time.sleep(0.02)


def engine_state(engine, carried: dict[str, Any]) -> bytes:
    """What a member carries across a change of group: model, optimizer, step count, and
    ``carried`` (where the loaders stand after that step, the run's start)."""
    buffer = io.BytesIO()
    state = {
        "model": engine.state_dict(),
        "optimizer": engine.optimizer.state_dict(),
        "steps": engine.steps_taken,
        **carried,
    }
    torch.save(state, buffer)
    return buffer.getvalue()


def generation_to_join(
    store: dist.Store, number: int, post: Post, launch_rank: int, min_devices: int, timeout_s: float
) -> Generation:
    """The generation this worker forms a group in: ``number`` as posted, or a newer one
    where a member died before everyone arrived (``gather``), so its members may differ
    from ``post``'s."""
    while True:
        generation = Generation(number, post.members, min_devices, post.joining)
        if launch_rank not in generation.members:
            raise RuntimeError(f"launch rank {launch_rank} was declared lost while alive.")
        newer = gather(store, generation, timeout_s)
        if newer is None:
            return generation
        number, post = newer, read_post(store, newer)


def regroup(elastic: ElasticWorker, post: Post) -> Generation:
    """Join the next generation's group (the caller dropped the old engine); its members
    are the returned generation's, which may be newer than ``post``
    (``generation_to_join``)."""
    number = elastic.generation.number + 1
    leave_group()  # first: a survivor still blocked in the old group waits on our sockets
    generation = generation_to_join(
        elastic.store, number, post, elastic.launch_rank, elastic.min_devices, elastic.timeout_s
    )
    reform(elastic.store, generation, elastic.launch_rank, elastic.backend, elastic.timeout_s)
    elastic.generation = generation
    return generation


def take_furthest_state(engine, own: bytes | None) -> dict[str, Any]:
    """Load, on every member, the state of the lowest rank with the most steps taken
    (sent as bytes; read with ``weights_only``); returns it. A replacement has none
    (``own`` None) and receives it."""
    steps = torch.load(io.BytesIO(own), weights_only=True)["steps"] if own else -1
    most = torch.tensor([steps], dtype=torch.int64)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    rank = comm.rank()
    source = torch.tensor([rank if steps == most.item() else comm.world_size()])
    dist.all_reduce(source, op=dist.ReduceOp.MIN)
    size = torch.tensor([len(own) if own else 0], dtype=torch.int64)
    dist.broadcast(size, src=int(source.item()))
    if rank == source.item():
        payload = torch.frombuffer(bytearray(own), dtype=torch.uint8)
    else:
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(payload, src=int(source.item()))
    state = torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)
    engine.load_state_dict(state["model"])
    engine.optimizer.load_state_dict(state["optimizer"])
    engine.steps_taken = state["steps"]
    return state


def shortfall_sentence(change: Change, minimum: int, saved: Path, steps: int) -> str:
    """The one sentence an elastic run ends with when too few workers are left."""
    return (
        f"worker(s) {', '.join(map(str, change.lost))} died in step {change.step}, leaving "
        f"{change.new} worker(s), fewer than --min-devices {minimum}; the last completed "
        f"step ({steps}) is saved in {saved}: resume with --resume {saved.parent.parent} "
        "at any device count."
    )


def stop_short(change: Change, minimum: int, saved: Path, steps: int) -> None:
    raise ElasticShortfall(shortfall_sentence(change, minimum, saved, steps))


def seconds_since(started: float) -> float:
    return time.perf_counter() - started
