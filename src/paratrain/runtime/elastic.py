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

Two deaths a moment apart: the launcher may post a generation after the first death that
still names the second worker. Forming that group would wait the whole timeout for it
(``init_process_group`` reads each member's address from the store), so each member first
leaves the old group (its sockets shut, which frees a survivor still blocked in it), then
says it has arrived, and forms the group only once every member has; while one is
missing and the launcher has posted a newer generation without it, the others move there
(``gather``).

Each generation's group lives under its own store prefix (``elastic/<generation>``), so a
group formed after a death never reads a key the previous one wrote.

Growing back: where the job allows replacements (``--max-restarts`` under ``--elastic``),
the launcher starts a fresh worker for each one lost, under a new launch rank (it sorts
after every survivor, so the lead never changes because of it, and a drill's faults for
the dead rank do not fire in it). The replacement loads its data, then says it is ready;
the launcher posts the next generation (survivors plus the ready replacements) and the
survivors, who look for a post at every step boundary while a replacement is announced,
form the new group there together with it. The launcher is the one author of
generations, so a death and a join never claim the same number.
"""

from __future__ import annotations

import gc
import json
import os
import re
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch.distributed as dist

from paratrain.runtime.hang import STORE_ENV
from paratrain.runtime.local_p2p import PeerProcessEnded

ELASTIC_KEY = "paratrain/launch/elastic"
"""Set by the workers of an elastic job: its terms (``ElasticTerms`` as JSON)."""
JOINING_ENV = "PARATRAIN_ELASTIC_JOINING"
"""Set in a replacement worker's environment: it joins a running job (no group of its own)."""
_MEMBERS = "paratrain/elastic/members/{generation}"
_COUNTER = "paratrain/elastic/generation"
"""The newest generation's number: taken with ``store.add`` by whoever posts one (the
launcher after a death, the lead when the group admits a replacement), so two posts never
share a number."""
_READY = "paratrain/elastic/ready/{rank}"
_ADMITTED = "paratrain/elastic/admitted/{rank}"
POST_WAIT_S = 5.0
"""How long a survivor whose collective failed waits for the launcher's post. The launcher
notices an exit within 0.35 s (its poll and the grace it gives a last result); a crashing
worker first prints its traceback; 5 s covers both on a loaded machine."""
PEER_GONE_MARKERS = (
    "Connection closed by peer",
    "Connection reset",
    "gloo",
    PeerProcessEnded.__name__,
)
"""What a worker's error says where it only noticed that a peer went away (gloo's socket,
or a shared-memory wait whose peer's process ended); the launcher reads them too."""
_COMM_ERROR_MARKERS = (*PEER_GONE_MARKERS, "Timed out")


class ElasticShortfall(RuntimeError):
    """Fewer workers are left than ``min_devices``: the run stops, its last step saved."""


class ElasticStateLost(RuntimeError):
    """The survivors of a death do not hold the whole training state between them (zero2's
    shard copies of two ring neighbours, both lost): the run goes back to the newest
    checkpoint. Its sentence names the survivors' launch ranks (``survivors_of``)."""

    def __init__(self, what: str, survivors: tuple[int, ...]) -> None:
        ranks = ", ".join(map(str, survivors))
        super().__init__(
            f"{what}; the {len(survivors)} survivors (launch ranks {ranks}) go back to the "
            "newest checkpoint."
        )


def survivors_of(details: str) -> list[int] | None:
    """The survivors' launch ranks an ``ElasticStateLost`` named, from a worker's error
    text; None where the text is no such error."""
    found = re.search(r"ElasticStateLost: .*\(launch ranks ([\d, ]+)\)", details)
    return [int(r) for r in found.group(1).split(",")] if found else None


@dataclass(frozen=True)
class ElasticTerms:
    """What the workers of an elastic job tell the launcher: the fewest workers it goes on
    with, how many replacements it may start, and the group's backend (a replacement
    forms its group with it)."""

    min_devices: int
    replacements: int = 0
    backend: str = "gloo"


@dataclass(frozen=True)
class Generation:
    """A group of workers: its number, the launch ranks in it (in order), the minimum the
    job was started with, and the replacements announced but not yet in it."""

    number: int
    members: tuple[int, ...]
    min_devices: int
    joining: tuple[int, ...] = ()

    @property
    def short(self) -> bool:
        return len(self.members) < self.min_devices


def mark_elastic(store: dist.Store, terms: ElasticTerms) -> None:
    """Tell the launcher this job goes on when workers die, on ``terms``."""
    store.set(ELASTIC_KEY, json.dumps(asdict(terms)))


def elastic_terms(store: dist.Store) -> ElasticTerms | None:
    """The job's terms if its workers marked it elastic, else None."""
    if not store.check([ELASTIC_KEY]):
        return None
    return ElasticTerms(**json.loads(store.get(ELASTIC_KEY).decode()))


@dataclass(frozen=True)
class Post:
    """A generation as the launcher posts it: its members and the replacements still
    on their way."""

    members: tuple[int, ...]
    joining: tuple[int, ...] = ()


def post_members(
    store: dist.Store, generation: int, members: list[int], joining: list[int] = ()
) -> None:
    """In the launcher: the launch ranks that make up ``generation``, and those coming."""
    post = {"members": sorted(members), "joining": sorted(joining)}
    store.set(_MEMBERS.format(generation=generation), json.dumps(post))


def next_generation(store: dist.Store) -> int:
    """A number for a new generation, taken atomically."""
    return store.add(_COUNTER, 1)


def latest_generation(store: dist.Store) -> int:
    """The newest generation's number (0: the job as started)."""
    return store.add(_COUNTER, 0)


def posted(store: dist.Store, generation: int) -> bool:
    """Whether the launcher has posted ``generation`` (a quick look, no wait)."""
    return store.check([_MEMBERS.format(generation=generation)])


def read_post(store: dist.Store, generation: int) -> Post:
    """``generation`` as posted (the caller knows it is there)."""
    post = json.loads(store.get(_MEMBERS.format(generation=generation)).decode())
    return Post(tuple(post["members"]), tuple(post["joining"]))


def joining() -> bool:
    """Whether this process is a replacement joining a running elastic job."""
    return os.environ.get(JOINING_ENV) == "1"


def announce_ready(store: dist.Store, launch_rank: int) -> None:
    """In a replacement: its data is loaded, it can join at the next step boundary."""
    store.set(_READY.format(rank=launch_rank), "1")


def is_ready(store: dist.Store, launch_rank: int) -> bool:
    return store.check([_READY.format(rank=launch_rank)])


def admit(store: dist.Store, generation: int, post: Post, newcomers: list[int]) -> None:
    """In the lead, at a step boundary the group agreed on: post ``generation`` and tell
    each newcomer which one it joins."""
    post_members(store, generation, list(post.members), list(post.joining))
    for rank in newcomers:
        store.set(_ADMITTED.format(rank=rank), str(generation))


def await_admission(store: dist.Store, launch_rank: int, timeout_s: float) -> int:
    """In a replacement: the generation the launcher admitted it to (blocks)."""
    key = _ADMITTED.format(rank=launch_rank)
    store.wait([key], timedelta(seconds=timeout_s))
    return int(store.get(key).decode())


def store_client(timeout_s: float) -> dist.TCPStore:
    """A client of the job's store (the launcher's), from the address every worker has."""
    host, _, port = os.environ[STORE_ENV].rpartition(":")
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))


def is_communication_error(error: BaseException) -> bool:
    """Whether ``error`` is a collective failing (a peer gone), not the worker's own fault."""
    text = f"{type(error).__name__}: {error}"
    return isinstance(error, RuntimeError) and any(m in text for m in _COMM_ERROR_MARKERS)


def await_members(store: dist.Store, generation: int, wait_s: float = POST_WAIT_S) -> Post | None:
    """What the launcher posted for ``generation``, or None if it posted nothing within
    ``wait_s`` (then no worker died and the failure is real)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if posted(store, generation):
            return read_post(store, generation)
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


def leave_group() -> None:
    """Close this worker's connections to its peers and destroy its default group, if it
    has one (the caller has dropped every object that held it). Done before waiting for
    the others at the next generation (``gather``): a survivor that is no neighbour of the
    dead worker is still blocked in the old collective, and is freed only when a peer's
    sockets close; waiting first would hold it there for the whole timeout."""
    close_group_sockets()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def gather(store: dist.Store, generation: Generation, timeout_s: float) -> int | None:
    """Arrive at ``generation`` and wait until all its members have: None then, or the
    number of a newer generation the launcher posted meanwhile without one of them (a
    member died before it arrived, as when two workers die a moment apart and the
    launcher sees one death, then the other). Forming the group first would wait the
    whole timeout for the dead member (``init_process_group`` reads each member's address
    from the store); the survivors move on to the newer generation instead. After
    ``timeout_s`` the group is formed anyway, so that its own error names what is missing."""
    arrived = f"paratrain/elastic/{generation.number}/arrived"
    store.add(arrived, 1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if store.add(arrived, 0) >= len(generation.members):
            return None
        newest = latest_generation(store)
        if newest > generation.number and posted(store, newest):
            # a newer generation without one of ours: a member was lost; one that keeps
            # them all admits replacements, which joins only after this one formed
            if not set(generation.members) <= set(read_post(store, newest).members):
                return newest
        time.sleep(0.02)
    return None


def reform(
    store: dist.Store, generation: Generation, launch_rank: int, backend: str, timeout_s: float
) -> None:
    """Join the next generation's group as the default group: the caller has left the
    old one first (``leave_group``, before ``gather``), or, a replacement, never had one.
    Ranks are the members' order: the lowest surviving launch rank becomes rank 0."""
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
    lost and the survivors are posted as the next generation; while the job's terms allow
    replacements, ``spawn`` starts one per death under the next unused launch rank (the
    group admits it at a step boundary, see ``admit``). Once fewer than the minimum are
    left the survivors save and stop with ``ElasticShortfall``, and any later death is a
    failure as usual.
    """

    def __init__(self, world_size: int, spawn: Callable[[int], None] | None = None) -> None:
        self.world_size = world_size
        self.pending: set[int] = set()
        """Replacements started and not yet in a posted generation."""
        self.next_rank = world_size
        self.replaced = 0
        self.spawn = spawn
        self.stopping = False

    def settle(self, store: dist.Store, deaths: set[int], failures: dict, lost: dict) -> None:
        terms = elastic_terms(store)
        if terms is None or self.stopping:
            return
        for rank in sorted(deaths):
            lost[rank] = failures.pop(rank)
        members = set(self.members(store))
        self.pending -= members | deaths  # admitted since, or died before it joined
        alive = members - deaths
        self.stopping = len(alive) < terms.min_devices
        for _ in deaths if not self.stopping and self.spawn else ():
            if self.replaced >= terms.replacements:
                break
            self.pending.add(self.next_rank)
            self.spawn(self.next_rank)
            self.next_rank += 1
            self.replaced += 1
        if members & deaths:  # the group changed: the survivors wait for this post
            post_members(store, next_generation(store), sorted(alive), sorted(self.pending))
        self._say(deaths, lost, len(alive), terms.min_devices)

    def members(self, store: dist.Store) -> tuple[int, ...]:
        """The launch ranks of the newest posted generation (everyone before any post)."""
        newest = latest_generation(store)
        return read_post(store, newest).members if newest else tuple(range(self.world_size))

    def unneeded(self, store: dist.Store, finished: set[int]) -> set[int]:
        """Replacements never admitted, once every member has finished: the run ended
        before they could join, and they are stopped rather than awaited."""
        members = set(self.members(store))
        self.pending -= members
        return set(self.pending) if members <= finished else set()

    def _say(self, deaths: set[int], lost: dict, alive: int, minimum: int) -> None:
        then = (
            f"fewer than the minimum {minimum} are left: they save the last completed step."
            if self.stopping
            else "they go on."
        )
        coming = f" ({len(self.pending)} replacement(s) starting)" if self.pending else ""
        for rank in sorted(deaths):
            print(
                f"paratrain: {lost[rank]} {alive} worker(s) remain{coming}; {then}",
                file=sys.stderr,
            )
