"""Point-to-point messages between processes on one host through shared memory.

The pipeline's stages exchange many small messages (an activation, its gradient) with
their neighbours; on a CPU, gloo's per-message cost (its threads' hand-offs, see
``shm_ring``) showed as idle time between passes. Where two neighbouring workers run on
one host, this transport gives them one ``shm_ring.Ring`` each way and moves every
message with the two processes' own threads: ``isend`` copies into the ring (or, where the
ring is full, leaves the rest to a pusher thread that writes it as the reader frees room:
sends never block, and bytes move while their sender computes or sits in a collective),
``irecv`` posts a buffer, and whatever waits (for a receive or a send) moves every pending
message of the process both ways.

Messages are matched as gloo matches them: by source and tag, in order among equal tags;
a message that comes before its receive is posted is kept aside (one copy more) until it
is. Waiting spins briefly (a message usually comes within microseconds on an idle core),
then sleeps on a named pipe that each writer pokes after it writes, so a waiting worker
leaves its core to others. Every wait is bounded by the process group's timeout and then
raises an error that says "timed out", which ``hang`` turns into one naming the peer.

Which pairs use it is agreed once per link set (``connect``): each side makes the ring it
reads, tells the other its path and host, and each says whether it could open the other's;
a pair uses shared memory only when both could, and gloo otherwise (another host, a
separate /dev/shm, a full tmpfs, not x86-64). The files are unlinked as soon as both
sides have them mapped, so nothing is left behind once the processes end.

A peer that ends: gloo's socket tells its neighbour at once, a ring cannot. So each side
also tells the other its process (``PeerProcess``), and a wait that sleeps looks every
``PEER_CHECK_S`` whether the peer it waits on still runs, and if not, says so rather than
waiting out the group's timeout (where the two see different process namespaces, it
cannot look, and the timeout stays the bound). Its error (``PeerProcessEnded``) is one the
launcher reads as a consequence, as it reads gloo's closed connection, so what the user
sees is the error of the rank that failed first.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import socket
import tempfile
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from paratrain.runtime.shm_ring import Ring, supported

RING_BYTES = 4 << 20
"""Bytes of each direction's ring (mapped by both processes; outside torch's storages,
the transport's own memory as gloo's buffers are gloo's). A message moves in frames of up
to a quarter of it, what does not fit as the reader frees room."""
SPIN_S = 50e-6
"""How long a wait polls before sleeping on the pipe."""
PEER_CHECK_S = 0.1
"""How often a sleeping wait looks whether its peer's process still runs."""
_PUSH_POLL_S = 1e-4
"""How often the pusher looks again at a ring it found full."""
_HANDSHAKE_TAG = 1 << 30
_HANDSHAKE_BYTES = 1024
ENV = "PARATRAIN_P2P"
"""``gloo`` keeps every pair on gloo; ``shared-memory`` (the default on CPU) uses it where
both sides can."""


def wanted() -> bool:
    """Whether ``ENV`` leaves shared memory on (unset, or ``shared-memory``); a value that
    names no transport is refused."""
    setting = os.environ.get(ENV, "").strip()
    if setting not in ("", "gloo", "shared-memory"):
        raise ValueError(
            f"{ENV}={setting!r} names no transport; set it to gloo or shared-memory "
            "(the default), or leave it unset."
        )
    return setting != "gloo"


def host_identity() -> str:
    """The host name and this boot of the kernel: two processes that share them share a
    host (and, where both can open the other's ring, its /dev/shm)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            boot = file.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def ring_directory() -> str:
    """/dev/shm where it exists (memory, never a disk), else the temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class PeerProcessEnded(RuntimeError):
    """A wait's peer process ended before its message moved: a consequence of that
    rank's failure, not this one's (the launcher reports that rank's error, as it does
    when gloo's connection to a peer closes)."""


class PeerProcess:
    """A peer's process, as this process sees it in /proc: gone once its entry is gone or
    it is a zombie, or its number belongs to a process started at another time."""

    def __init__(self, pid: int, started: str) -> None:
        self.pid, self.started = pid, started

    @staticmethod
    def identity() -> dict | None:
        """What a peer needs to watch this process (None where /proc cannot say)."""
        try:
            namespace = os.readlink("/proc/self/ns/pid")
            _, started = _stat("self")
        except (OSError, IndexError):
            return None
        return {"pid": os.getpid(), "started": started, "namespace": namespace}

    @classmethod
    def watch(cls, theirs: dict | None, mine: dict | None) -> PeerProcess | None:
        """The peer of ``identity()`` ``theirs``, where this process (``mine``) can watch
        it: the same process namespace (a number means the same process on both sides)."""
        if not theirs or not mine or theirs["namespace"] != mine["namespace"]:
            return None
        return cls(int(theirs["pid"]), str(theirs["started"]))

    def ended(self) -> bool:
        try:
            state, started = _stat(str(self.pid))
        except FileNotFoundError:
            return True
        except (OSError, IndexError):  # cannot tell: the timeout stays the bound
            return False
        return state in ("Z", "X", "x") or started != self.started


def _stat(pid: str) -> tuple[str, str]:
    """A process's state and start time (fields 3 and 22 of /proc/PID/stat; the command
    name before them may hold spaces and parentheses, so they are counted from its end)."""
    with open(f"/proc/{pid}/stat") as file:
        fields = file.read().rpartition(")")[2].split()
    return fields[0], fields[19]


class _Work:
    """A send or a posted receive of ``peer`` under ``tag``; ``wait`` moves messages (both
    ways) until it is done, as a gloo work's ``wait`` does."""

    what = "message of tag {tag} with rank {peer}"
    """What a timeout names (formatted with ``tag`` and ``peer``)."""

    def __init__(self, box: SharedMemoryP2P, peer: int, tag: int, tensor: torch.Tensor) -> None:
        self.box, self.peer, self.tag = box, peer, tag
        flat = tensor.dtype == torch.uint8 and tensor.dim() == 1
        self.bytes = tensor if flat else tensor.reshape(-1).view(torch.uint8)
        self.done = False

    def wait(self) -> bool:
        self.box.wait_for(self, self.what.format(tag=self.tag, peer=self.peer))
        return True


class _Send(_Work):
    """One message on its way out: done once all its bytes are in the ring."""

    what = "send of tag {tag} to rank {peer}"

    def __init__(self, box: SharedMemoryP2P, peer: int, tag: int, tensor: torch.Tensor) -> None:
        super().__init__(box, peer, tag, tensor)
        self.sent = 0


class _Receive(_Work):
    """A posted receive: done once its buffer holds the message."""

    what = "receive of tag {tag} from rank {peer}"


def _check_size(message_bytes: int, receive: _Receive, tag: int) -> None:
    if message_bytes != receive.bytes.numel():
        raise RuntimeError(
            f"a message of {message_bytes} bytes came for a receive of "
            f"{receive.bytes.numel()} (tag {tag}): the two sides disagree on its shape."
        )


def finished(work: object) -> bool:
    """Whether ``work`` is this transport's and done (its wait would return at once); a
    gloo work always goes through its own ``wait``, which raises its errors."""
    return isinstance(work, _Work) and work.done


class _Incoming:
    """What one peer sends this process: its ring, and the messages matched so far."""

    def __init__(self, ring: Ring, pipe: int) -> None:
        self.ring, self.pipe = ring, pipe
        self.posted: dict[int, deque[_Receive]] = {}
        self.arrived: dict[int, deque[torch.Tensor]] = {}
        self.filling: torch.Tensor | None = None  # the bytes the current message goes to
        self.filling_receive: _Receive | None = None
        self.filled = 0

    def drain(self) -> bool:
        """Take every frame written so far; True if there was any."""
        moved = False
        while (frame := self.ring.peek()) is not None:
            tag, message_bytes, source, nbytes = frame
            if self.filling is None:
                self._start(tag, message_bytes)
            if nbytes:
                ctypes.memmove(self.filling.data_ptr() + self.filled, source, nbytes)
            self.filled += nbytes
            self.ring.consume(nbytes)
            moved = True
            if self.filled == self.filling.numel():
                self._finish(tag)
        return moved

    def _start(self, tag: int, message_bytes: int) -> None:
        waiting = self.posted.get(tag)
        if waiting:
            receive = waiting.popleft()
            _check_size(message_bytes, receive, tag)
            self.filling, self.filling_receive = receive.bytes, receive
        else:
            self.filling = torch.empty(message_bytes, dtype=torch.uint8)
        self.filled = 0

    def _finish(self, tag: int) -> None:
        """A message is whole: its receive is done, or it is kept aside, or (a receive
        posted while it was coming in pieces) copied into that receive now."""
        receive, message = self.filling_receive, self.filling
        self.filling, self.filling_receive = None, None
        if receive is None:
            waiting = self.posted.get(tag)
            if not waiting:
                self.arrived.setdefault(tag, deque()).append(message)
                return
            receive = waiting.popleft()
            _check_size(message.numel(), receive, tag)
            receive.bytes.copy_(message)
        receive.done = True


class _Outgoing:
    """What this process sends one peer: its ring, its pipe, and the sends not yet in it."""

    def __init__(self, ring: Ring, pipe: int) -> None:
        self.ring, self.pipe = ring, pipe
        self.pending: deque[_Send] = deque()

    def push(self) -> bool:
        """Write as much of the pending sends as fits; True if any byte moved."""
        moved = False
        while self.pending:
            send = self.pending[0]
            total = send.bytes.numel()
            while send.sent < total or total == 0:
                piece = min(total - send.sent, self.ring.max_frame)
                source = send.bytes.data_ptr() + send.sent
                if not self.ring.try_write(send.tag, total, source, piece):
                    if moved:
                        _poke(self.pipe)
                    return moved
                send.sent += piece
                moved = True
                if total == 0:
                    break
            send.done = True
            self.pending.popleft()
        if moved:
            _poke(self.pipe)
        return moved


def _poke(pipe: int) -> None:
    """Wake the reader if it sleeps (a full pipe already will)."""
    try:
        os.write(pipe, b"\0")
    except BlockingIOError:
        pass


class SharedMemoryP2P:
    """This process's shared-memory connections, with the peers ``connect`` agreed on."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.incoming: dict[int, _Incoming] = {}
        self.outgoing: dict[int, _Outgoing] = {}
        self._lock = threading.Lock()  # the outgoing queues: this thread's and the pusher's
        self.close_pipes: Callable[[], object] = lambda: None
        """Closes the pipes once (``connect`` sets it, a finalizer of this object)."""
        self.failure: BaseException | None = None
        """What stopped the pusher writing this set's sends, raised by the next wait."""
        self.peer_processes: dict[int, PeerProcess] = {}
        """The peers' processes, where this process can watch them (``PeerProcess``)."""

    def covers(self, peer: int) -> bool:
        return peer in self.outgoing

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> _Send:
        """Send a contiguous tensor; keep it unchanged until the returned work is done."""
        send = _Send(self, dst, tag, tensor)
        out = self.outgoing[dst]
        with self._lock:
            out.pending.append(send)
            if len(out.pending) == 1:
                out.push()
            if out.pending:
                self._push_later()
        return send

    def _push_later(self) -> None:
        """Have the pusher thread write what did not fit as the reader frees room: this
        thread may next block in a collective that the reader waits on for these bytes
        (a tensor group's all-reduce, say), so they must move without it."""
        _PUSHER.add(self)

    def push_pending(self) -> bool:
        """Write what fits of the pending sends; True if some are left."""
        with self._lock:
            for out in self.outgoing.values():
                if out.pending:
                    out.push()
            return any(out.pending for out in self.outgoing.values())

    def irecv(self, buffer: torch.Tensor, src: int, tag: int) -> _Receive:
        """Post a receive into a contiguous ``buffer``: matched with a message kept aside
        if one is, else posted first and then what has come is taken, so that its message,
        if it is in the ring, goes straight into ``buffer`` (not kept aside, then copied)."""
        receive = _Receive(self, src, tag, buffer)
        incoming = self.incoming[src]
        kept = incoming.arrived.get(tag)
        if kept:
            message = kept.popleft()
            _check_size(message.numel(), receive, tag)
            receive.bytes.copy_(message)
            receive.done = True
        else:
            incoming.posted.setdefault(tag, deque()).append(receive)
        incoming.drain()
        return receive

    def progress(self) -> bool:
        """Move what can move, both ways; True if anything did."""
        moved = False
        with self._lock:
            for out in self.outgoing.values():
                if out.pending:
                    moved |= out.push()
        for incoming in self.incoming.values():
            moved |= incoming.drain()
        return moved

    def wait_for(self, work: _Work, what: str) -> None:
        """Progress until ``work`` is done; spin briefly, then sleep on the pipes."""
        if work.done:
            return
        began = time.monotonic()
        deadline, look_at_peer = began + self.timeout_s, began + PEER_CHECK_S
        spin_until = time.perf_counter() + SPIN_S
        pipes = [incoming.pipe for incoming in self.incoming.values()]
        while True:
            self.progress()
            if work.done:
                return
            if self.failure is not None:
                raise RuntimeError(f"{what} failed: {self.failure}") from self.failure
            if time.perf_counter() < spin_until:
                continue
            now = time.monotonic()
            if now > deadline:
                raise RuntimeError(
                    f"{what} timed out after {self.timeout_s:.0f} s (shared-memory point-to-point)"
                )
            if now > look_at_peer:
                look_at_peer = now + PEER_CHECK_S
                self._check_peer(work.peer, what)
            blocked = any(out.pending for out in self.outgoing.values())
            ready, _, _ = select.select(pipes, [], [], 1e-4 if blocked else 0.05)
            for pipe in ready:
                try:
                    os.read(pipe, 1 << 16)
                except BlockingIOError:
                    pass

    def _check_peer(self, peer: int, what: str) -> None:
        """Raise if ``peer``'s process has ended (nothing more will come from it)."""
        process = self.peer_processes.get(peer)
        if process is not None and process.ended():
            raise PeerProcessEnded(
                f"{what} failed: rank {peer}'s process ({process.pid}) ended before the "
                f"message moved; that rank's own error says why."
            )

    def close(self) -> None:
        """Unmap the rings and close the pipes now (a set that becomes garbage has its
        pipes closed by ``close_pipes`` and its rings unmapped with it)."""
        with self._lock:  # the pusher's scan holds it
            sides = [*self.incoming.values(), *self.outgoing.values()]
            self.incoming.clear()
            self.outgoing.clear()
        for side in sides:
            side.ring.close()
        self.close_pipes()


class _Pusher:
    """One thread per process that writes the sends full rings left, for every set of
    connections that has some; it holds them weakly, so a set whose engine is gone is
    unmapped as usual."""

    def __init__(self) -> None:
        self._boxes: weakref.WeakSet[SharedMemoryP2P] = weakref.WeakSet()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._guard = threading.Lock()

    def add(self, box: SharedMemoryP2P) -> None:
        with self._guard:
            self._boxes.add(box)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True)
                self._thread.start()
        self._wake.set()

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()  # before the scan: a send queued during it wakes the next
            if self._scan():
                self._wake.set()
                time.sleep(_PUSH_POLL_S)

    def _scan(self) -> bool:
        """Push every set's pending sends; True if some are left. Its own frame, so that
        no reference to a set outlives the scan."""
        with self._guard:
            boxes = list(self._boxes)
        done = [box for box in boxes if not _pushed_with_some_left(box)]
        with self._guard:
            for box in done:
                self._boxes.discard(box)
        return len(done) < len(boxes)


def _pushed_with_some_left(box: SharedMemoryP2P) -> bool:
    try:
        return box.push_pending()
    except Exception as error:  # reaches the user at this set's next wait
        box.failure = error
        return False


_PUSHER = _Pusher()


def _exchange(peer: int, message: dict, tag: int) -> dict:
    """Send ``message`` to ``peer`` and receive its, over gloo (both sides call it)."""
    out = torch.zeros(_HANDSHAKE_BYTES, dtype=torch.uint8)
    encoded = json.dumps(message).encode()
    out[: len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    back = torch.zeros(_HANDSHAKE_BYTES, dtype=torch.uint8)
    works = [dist.isend(out, dst=peer, tag=tag), dist.irecv(back, src=peer, tag=tag)]
    for work in works:
        work.wait()
    return json.loads(bytes(back.tolist()).rstrip(b"\0").decode())


def _make_ring(capacity: int) -> tuple[str | None, str]:
    """A ring file and its pipe for a peer to write into; (None, why) where none can be."""
    if not supported():
        return None, "not x86-64"
    directory = ring_directory()
    try:
        path = Ring.create(directory, capacity)
    except OSError as error:
        return None, f"no ring of {capacity} bytes could be made in {directory} ({error})"
    try:
        os.mkfifo(path + ".pipe", 0o600)
    except OSError as error:
        os.unlink(path)
        return None, f"no pipe could be made in {directory} ({error})"
    return path, ""


def _open_pipe(path: str) -> int:
    return os.open(path + ".pipe", os.O_RDWR | os.O_NONBLOCK)


def connect(
    peers: Iterable[int], *, timeout_s: float, capacity: int = RING_BYTES
) -> SharedMemoryP2P:
    """Agree with each peer (which calls it too, naming this rank) whether the pair moves
    its messages through shared memory, and map the rings of the pairs that do."""
    box = SharedMemoryP2P(timeout_s)
    host = host_identity()
    for peer in sorted(set(peers)):  # every pair in one order on both sides: no deadlock
        pair = _pair(peer, host, capacity)
        if pair is not None:
            box.incoming[peer], box.outgoing[peer], process = pair
            if process is not None:
                box.peer_processes[peer] = process
    pipes = [side.pipe for side in (*box.incoming.values(), *box.outgoing.values())]
    box.close_pipes = weakref.finalize(box, _close_all, pipes)
    return box


def _pair(
    peer: int, host: str, capacity: int
) -> tuple[_Incoming, _Outgoing, PeerProcess | None] | None:
    """This rank's two sides of its connection with ``peer`` and the peer's process where
    it can be watched, or None where the pair keeps gloo (said in a warning where the two
    share a host: a full tmpfs, say)."""
    path, why = _make_ring(capacity)
    me = PeerProcess.identity()
    offer = {"host": host, "ring": path, "why": why, "process": me}
    theirs = _exchange(peer, offer, _HANDSHAKE_TAG)
    opened = None
    if path and theirs["ring"] and theirs["host"] == host:
        try:
            opened = Ring(theirs["ring"], capacity), _open_pipe(theirs["ring"])
        except OSError as error:
            why = f"could not map rank {peer}'s ring ({error})"
    answer = _exchange(peer, {"opened": opened is not None, "why": why}, _HANDSHAKE_TAG + 1)
    mine = None
    if path:
        try:
            if answer["opened"] and opened is not None:
                mine = Ring(path, capacity), _open_pipe(path)
        finally:
            os.unlink(path)
            os.unlink(path + ".pipe")
    if mine is not None and opened is not None:
        return _Incoming(*mine), _Outgoing(*opened), PeerProcess.watch(theirs.get("process"), me)
    if opened is not None:
        opened[0].close()
        os.close(opened[1])
    if theirs["host"] == host and supported():
        reason = why or theirs["why"] or answer["why"]
        warnings.warn(
            f"rank {dist.get_rank()} and rank {peer} share a host but keep gloo for their "
            f"pipeline messages: {reason}.",
            stacklevel=3,
        )
    return None


def _close_all(pipes: list[int]) -> None:
    for pipe in pipes:
        os.close(pipe)
