"""Each worker its own random stream, reproducible from the seed the workers started with.

Why: the usual recipe (``torch.manual_seed(0)`` in every worker, so that every replica
builds the same initial model) also leaves every worker's generator in the same state, so
every replica would draw the same dropout masks on its share of the batch. N replicas
would then apply one mask pattern N times, and how strongly dropout regularises would
depend on the device count.

What each worker's stream is, once an engine has made the parameters equal:

- The job's rank 0 keeps its generator as it is, so one worker draws exactly what the
  single-device engine (or a plain loop) draws after the same seeding: ``dp`` on one
  device equals ``single`` with dropout too.
- Every other rank ``r`` seeds its generator (the CPU one, and its GPU's where it computes
  on one) with ``base + r``, where ``base`` is a 62-bit number drawn from a copy of the
  replica group's first rank's CPU generator (its own stream does not advance) and sent
  to every member. The same seed therefore gives the same streams in every run, whatever
  the other workers seeded.

Per rank, not per replica, because every worker computes something different: a pipeline
stage runs other layers than its neighbours, so its stream needs no relation to theirs.
A stage draws its micro-batches' masks in micro-batch order (every schedule runs a
stage's forwards in that order, and recompute replays the generator state it saved), so
the masks do not depend on the schedule. A checkpoint saves every rank's generator and a
resumed worker continues its own (see ``checkpointing``).
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from paratrain.runtime import comm

SEED_BOUND = 2**62
"""Bases are drawn below this and seeds taken modulo it: inside the range of ``int64``
(what ``torch.randint`` draws) and of ``torch.manual_seed``."""


def draw_base() -> int:
    """A 62-bit number from a copy of this process's CPU generator (which stays as it was)."""
    peek = torch.Generator().set_state(torch.get_rng_state())
    return int(torch.randint(0, SEED_BOUND, (1,), generator=peek, dtype=torch.int64))


def rank_seed(base: int, rank: int) -> int:
    """The seed of rank ``rank``'s stream (rank 0 keeps its own and uses none)."""
    return (base + rank) % SEED_BOUND


def separate_streams(*, group: ProcessGroup | None = None, agree: bool = True) -> int | None:
    """Give this worker its own stream (see the module docstring); every member of
    ``group`` calls it. Returns the seed this worker took, or None where it kept its own.

    ``agree=False`` is for workers that never wait on one another (ps): each draws the
    base from its own generator with no message, which gives every worker the same base
    when they were seeded alike (the usual recipe, the one that needs separating) and
    different streams anyway when they were not.
    """
    if not comm.distributed():
        return None
    base = torch.tensor([draw_base()], dtype=torch.int64)
    if agree:
        comm.broadcast_tensors([base], src=0, group=group)
    rank = comm.rank()
    if rank == 0:
        return None
    seed = rank_seed(int(base[0]), rank)
    torch.manual_seed(seed)  # the CPU generator and every visible GPU's
    return seed
