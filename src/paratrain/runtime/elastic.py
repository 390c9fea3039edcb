"""Elastic local jobs: the launcher says who is left, the survivors form a new group.

Why the launcher is the referee: a survivor sees only that a collective failed ("Connection
reset by peer"), which a dead peer, a peer that dropped a dead group, or a real network
fault all look like. The launcher sees the process exit (within a fraction of a second), so
it alone decides that a worker is gone: it posts the members of the next generation on the
job's store, and a survivor whose collective failed waits a few seconds for that post. No
post means no worker died: the error is real and is raised as it was.

How a blocked collective ends: gloo has no working abort for a waiting receive, but a
worker's sockets close when its group is destroyed and freed, and a peer waiting on a
closed socket fails at once. The dead worker's neighbours fail first; each survivor drops
every reference to the old group (the whole engine) and destroys it, so its own peers fail
in turn. Measured on this machine: every survivor out of its collective within 20 ms of the
kill, without waiting for any timeout.

Each generation's group lives under its own store prefix (``elastic/<generation>``), so a
group formed after a death never reads a key the previous one wrote.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from paratrain.runtime.hang import STORE_ENV

ELASTIC_KEY = "paratrain/launch/elastic"
"""Set by the workers of an elastic job: its minimum worker count."""
_MEMBERS = "paratrain/elastic/members/{generation}"
POST_WAIT_S = 5.0
"""How long a survivor whose collective failed waits for the launcher's post. The launcher
notices an exit within 0.35 s (its poll and the grace it gives a last result); a crashing
worker first prints its traceback; 5 s covers both on a loaded machine."""
_COMM_ERROR_MARKERS = ("Connection closed by peer", "Connection reset", "gloo", "Timed out")


class ElasticShortfall(RuntimeError):
    """Fewer workers are left than ``min_devices``: the run stops, its last step saved."""


@dataclass(frozen=True)
class Generation:
    """A group of survivors: its number, the launch ranks in it (in order), and the
    minimum the job was started with."""

    number: int
    members: tuple[int, ...]
    min_devices: int

    @property
    def short(self) -> bool:
        return len(self.members) < self.min_devices


def mark_elastic(store: dist.Store, min_devices: int) -> None:
    """Tell the launcher this job goes on when workers die, down to ``min_devices``."""
    store.set(ELASTIC_KEY, str(min_devices))


def elastic_minimum(store: dist.Store) -> int | None:
    """The job's minimum worker count if its workers marked it elastic, else None."""
    if not store.check([ELASTIC_KEY]):
        return None
    return int(store.get(ELASTIC_KEY).decode())


def post_members(store: dist.Store, generation: int, members: list[int]) -> None:
    """In the launcher: the launch ranks that make up ``generation``."""
    store.set(_MEMBERS.format(generation=generation), json.dumps(sorted(members)))


def store_client(timeout_s: float) -> dist.TCPStore:
    """A client of the job's store (the launcher's), from the address every worker has."""
    host, _, port = os.environ[STORE_ENV].rpartition(":")
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))


def is_communication_error(error: BaseException) -> bool:
    """Whether ``error`` is a collective failing (a peer gone), not the worker's own fault."""
    text = f"{type(error).__name__}: {error}"
    return isinstance(error, RuntimeError) and any(m in text for m in _COMM_ERROR_MARKERS)


def await_members(store: dist.Store, generation: int, wait_s: float = POST_WAIT_S) -> list | None:
    """The members the launcher posted for ``generation``, or None if it posted none within
    ``wait_s`` (then no worker died and the failure is real)."""
    key = _MEMBERS.format(generation=generation)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if store.check([key]):
            return json.loads(store.get(key).decode())
        time.sleep(0.02)
    return None


def close_group_sockets() -> None:
    """Shut down this worker's connections to its peers (not those to the store): a peer
    blocked in a collective with this worker then fails at once. Destroying the group is
    not enough: a gloo context stays alive, sockets open, while anything still holds one
    of its operations (measured: an async all-reduce that failed, held past its error,
    kept a peer waiting for the whole timeout). ``shutdown`` acts on the connection, so a
    duplicate of the descriptor is used and closed, and the group's own stays valid."""
    store_port = int(os.environ[STORE_ENV].rpartition(":")[2])
    for name in os.listdir("/proc/self/fd"):
        try:
            duplicate = os.dup(int(name))
        except OSError:  # closed since the listing
            continue
        try:
            connection = socket.socket(fileno=duplicate)
        except OSError:  # not a socket
            os.close(duplicate)
            continue
        with connection:
            if connection.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            if connection.type != socket.SOCK_STREAM:
                continue
            try:
                peer_port = connection.getpeername()[1]
            except OSError:  # a listening socket: no peer
                continue
            if peer_port == store_port or connection.getsockname()[1] == store_port:
                continue
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                continue


def reform(
    store: dist.Store, generation: Generation, launch_rank: int, backend: str, timeout_s: float
) -> None:
    """Destroy the current default group and join the next generation's as the default
    group (the caller has dropped every object that held the old one). Ranks are the
    members' order: the lowest surviving launch rank becomes rank 0."""
    close_group_sockets()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
    rank = generation.members.index(launch_rank)
    prefix = dist.PrefixStore(f"paratrain/elastic/{generation.number}", store)
    dist.init_process_group(
        backend,
        store=prefix,
        rank=rank,
        world_size=len(generation.members),
        timeout=timedelta(seconds=timeout_s),
    )
    os.environ["WORLD_SIZE"] = str(len(generation.members))


class ElasticReferee:
    """In the launcher: turns the deaths of an elastic job's workers into generations.

    A worker that dies (killed, or exited without a result: an elastic worker whose own
    step raised exits that way, see ``run/elastic``) is moved from the failures to the
    lost and the survivors are posted as the next generation. Once fewer than the minimum
    are left the survivors save and stop with ``ElasticShortfall``, and any later death
    is a failure as usual.
    """

    def __init__(self, world_size: int) -> None:
        self.alive = set(range(world_size))
        self.generation = 0
        self.stopping = False

    def settle(self, store: dist.Store, deaths: set[int], failures: dict, lost: dict) -> None:
        minimum = elastic_minimum(store)
        if minimum is None or self.stopping:
            return
        for rank in sorted(deaths):
            lost[rank] = failures.pop(rank)
        self.alive -= deaths
        self.generation += 1
        self.stopping = len(self.alive) < minimum
        post_members(store, self.generation, sorted(self.alive))
        then = (
            f"fewer than the minimum {minimum} are left: they save the last completed step."
            if self.stopping
            else "they go on."
        )
        for rank in sorted(deaths):
            print(
                f"paratrain: {lost[rank]} {len(self.alive)} worker(s) remain; {then}",
                file=sys.stderr,
            )
