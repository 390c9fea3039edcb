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
    Generation,
    await_members,
    is_communication_error,
    mark_elastic,
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

    @classmethod
    def join(cls, launch_rank: int, min_devices: int, timeout_s: float) -> ElasticWorker:
        """Mark the job elastic on the launcher's store; generation 0 is everyone."""
        store = store_client(timeout_s)
        mark_elastic(store, min_devices)
        members = tuple(range(comm.world_size()))
        backend = dist.get_backend()
        generation = Generation(0, members, min_devices)
        return cls(launch_rank, min_devices, backend, timeout_s, generation, store)


@dataclass(frozen=True)
class Change:
    """One change of worker count, as recorded."""

    step: int
    old: int
    new: int
    lost: tuple[int, ...]
    seconds_lost: float
    steps_redone: int

    def record(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "old_workers": self.old,
            "new_workers": self.new,
            "lost_ranks": list(self.lost),
            "seconds_lost": round(self.seconds_lost, 3),
            "steps_redone": self.steps_redone,
        }

    def line(self) -> str:
        ranks = ", ".join(str(r) for r in self.lost)
        redone = f"step {self.step} redone" if self.steps_redone else "no step redone"
        return (
            f"paratrain: worker {ranks} lost in step {self.step}; {self.new} of {self.old} "
            f"workers go on ({redone}, {self.seconds_lost:.2f} s lost)."
        )


def attempt_step(body: Callable[[], Any], elastic: ElasticWorker) -> tuple[bool, Any]:
    """Run ``body`` (the step, its log, the stop vote); returns (True, its value), or
    (False, the next generation's members) where a peer died during it. A collective that
    failed with nobody dead is raised as it was; this worker's own error ends it (see the
    module docstring). The traceback is dropped before returning: it holds the engine,
    and through it the old group, whose sockets must close for the others to notice."""
    try:
        return True, body()
    except Exception as error:  # noqa: BLE001 - sorted below: a peer's death or our own fault
        if not is_communication_error(error):
            _exit_as_lost()
        members = await_members(elastic.store, elastic.generation.number + 1)
        if members is None:
            raise
    return False, members


def _exit_as_lost() -> None:
    """This worker's own step failed: say why, and leave as a dead worker would."""
    traceback.print_exc(file=sys.stderr)
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(1)


def engine_state(engine) -> bytes:
    """What a replica carries across a change of group: model, optimizer, step count."""
    buffer = io.BytesIO()
    state = {
        "model": engine.state_dict(),
        "optimizer": engine.optimizer.state_dict(),
        "steps": engine.steps_taken,
    }
    torch.save(state, buffer)
    return buffer.getvalue()


def regroup(elastic: ElasticWorker, members: list[int]) -> Generation:
    """Join the next generation's group (the caller dropped the old engine)."""
    generation = Generation(elastic.generation.number + 1, tuple(members), elastic.min_devices)
    if elastic.launch_rank not in generation.members:
        raise RuntimeError(f"launch rank {elastic.launch_rank} was declared lost while alive.")
    reform(elastic.store, generation, elastic.launch_rank, elastic.backend, elastic.timeout_s)
    elastic.generation = generation
    return generation


def take_furthest_state(engine, own: bytes) -> int:
    """Load, on every survivor, the state of the lowest rank with the most steps taken
    (sent as bytes; read with ``weights_only``); returns that step count."""
    steps = torch.load(io.BytesIO(own), weights_only=True)["steps"]
    most = torch.tensor([steps], dtype=torch.int64)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    rank = comm.rank()
    source = torch.tensor([rank if steps == most.item() else comm.world_size()])
    dist.all_reduce(source, op=dist.ReduceOp.MIN)
    size = torch.tensor([len(own)], dtype=torch.int64)
    dist.broadcast(size, src=int(source.item()))
    payload = torch.frombuffer(bytearray(own), dtype=torch.uint8)
    if rank != source.item():
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(payload, src=int(source.item()))
    state = torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)
    engine.load_state_dict(state["model"])
    engine.optimizer.load_state_dict(state["optimizer"])
    engine.steps_taken = state["steps"]
    return state["steps"]


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
