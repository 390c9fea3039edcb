"""Worker functions of tests/test_local_p2p.py (importable by launched workers)."""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist

from paratrain.runtime import local_p2p
from paratrain.runtime.local_p2p import connect


def sample_messages() -> dict[int, torch.Tensor]:
    """Tagged messages of several sizes and dtypes, one empty."""
    generator = torch.Generator().manual_seed(0)
    return {
        3: torch.randn(5, 7, generator=generator),
        1: torch.arange(11, dtype=torch.int64),
        2: torch.randn(300_000, generator=generator).to(torch.bfloat16),
        7: torch.empty(0),
        4: torch.tensor([True, False, True]),
    }


def out_of_order_worker(capacity: int, mode: str) -> dict:
    """Rank 0 sends the messages in one order, rank 1 receives them in another: its
    receives posted before the sends (``posted-first``), after the messages came
    (``came-first``), or posted and waited on while rank 0 sits in a barrier, so that
    what did not fit in the ring must move without rank 0's thread (``sender-blocked``).
    Returns what rank 1 got."""
    box = connect([1 - dist.get_rank()], timeout_s=60, capacity=capacity)
    messages = sample_messages()
    got = {}
    if dist.get_rank() == 0:
        if mode == "posted-first":
            dist.barrier()  # rank 1 has posted
        works = [box.isend(messages[tag], 1, tag) for tag in messages]
        if mode != "posted-first":
            dist.barrier()
        for work in works:
            work.wait()
    else:
        buffers = {tag: torch.empty_like(value) for tag, value in sorted(messages.items())}
        if mode == "came-first":
            dist.barrier()  # the messages have come, or some of them (the ring is full)
        works = {tag: box.irecv(buffer, 0, tag) for tag, buffer in buffers.items()}
        if mode == "posted-first":
            dist.barrier()
        for work in reversed(works.values()):
            work.wait()
        if mode == "sender-blocked":
            dist.barrier()
        got = buffers
    covered = box.covers(1 - dist.get_rank())
    box.close()
    return {"got": got, "covered": covered}


def waiting_in_ring_worker() -> dict:
    """Rank 0's message is whole in the ring before rank 1 posts its receive: rank 1
    reports whether the receive was done at once and whether the message was ever kept
    aside (an extra buffer and copy) rather than copied straight into its buffer."""
    box = connect([1 - dist.get_rank()], timeout_s=60)
    message = torch.arange(40_000, dtype=torch.float32)
    result = {}
    if dist.get_rank() == 0:
        box.isend(message, 1, 5).wait()  # done: every byte is in the ring
        dist.barrier()
    else:
        dist.barrier()
        buffer = torch.empty_like(message)
        receive = box.irecv(buffer, 0, 5)
        result = {
            "done": receive.done,
            "kept_aside": 5 in box.incoming[0].arrived,
            "exact": torch.equal(buffer, message),
        }
    dist.barrier()
    box.close()
    return result


def both_ways_worker(capacity: int, count: int) -> dict:
    """Both ranks send each other ``count`` messages larger than the ring before either
    posts a receive, then receive them: sends must not block, and two waiting sides must
    move each other's messages."""
    rank = dist.get_rank()
    peer = 1 - rank
    box = connect([peer], timeout_s=60, capacity=capacity)
    size = capacity  # four frames each
    outgoing = [torch.full((size // 4,), float(rank * 100 + i)) for i in range(count)]
    started = time.perf_counter()
    sends = [box.isend(tensor, peer, i) for i, tensor in enumerate(outgoing)]
    queued_s = time.perf_counter() - started
    buffers = [torch.empty(size // 4) for _ in range(count)]
    receives = [box.irecv(buffer, peer, i) for i, buffer in enumerate(buffers)]
    for work in [*receives, *sends]:
        work.wait()
    box.close()
    return {"values": [b.unique().tolist() for b in buffers], "queued_s": queued_s}


def timeout_worker() -> str:
    """Rank 1 waits for a message rank 0 never sends; returns the error's words."""
    box = connect([1 - dist.get_rank()], timeout_s=1.0)
    message = ""
    if dist.get_rank() == 1:
        try:
            box.irecv(torch.empty(3), 0, 9).wait()
        except RuntimeError as error:
            message = str(error)
    dist.barrier()
    box.close()
    return message


def agreement_worker(other_host_rank: int | None, full_rank: int | None) -> dict:
    """Connect with the peer, rank ``other_host_rank`` pretending to run on another host
    and rank ``full_rank`` finding no room for its ring; returns whether the pair uses
    shared memory, the warnings this rank gave, and the ring files left behind."""
    import warnings

    from paratrain.runtime.shm_ring import Ring

    if dist.get_rank() == other_host_rank:
        local_p2p.host_identity = lambda: "elsewhere/0"
    if dist.get_rank() == full_rank:

        def no_room(directory: str, capacity: int) -> str:
            raise OSError(28, "No space left on device")

        Ring.create = staticmethod(no_room)
    before = set(os.listdir(local_p2p.ring_directory()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        box = connect([1 - dist.get_rank()], timeout_s=60)
    dist.barrier()
    after = set(os.listdir(local_p2p.ring_directory()))
    covered = box.covers(1 - dist.get_rank())
    box.close()
    left = sorted(name for name in after - before if name.startswith("paratrain-ring-"))
    return {"covered": covered, "left": left, "warned": [str(w.message) for w in caught]}


def link_transport_worker() -> dict:
    """Whether a CPU pipeline's links move their messages through shared memory."""
    from paratrain.parallel.pipeline.chunks import chunk_links
    from paratrain.runtime.mesh import Mesh

    rank = dist.get_rank()
    mesh = Mesh(1, 2, 1, 0, rank, 0, dp_group=None, tensor_group=None)
    links = chunk_links(mesh, torch.device("cpu"), 2, window=2)
    peer = 1 - rank
    return {"shared": [link._local is not None and link._local.covers(peer) for link in links]}


def dropped_worker() -> dict:
    """A set of connections whose sends needed the pusher, dropped once done: returns
    whether it was freed and its pipes closed (they are fds of this process)."""
    import gc
    import weakref

    rank = dist.get_rank()
    box = connect([1 - rank], timeout_s=60, capacity=64 << 10)
    message = torch.arange(100_000, dtype=torch.float32)  # 400 KB: the pusher's work
    if rank == 0:
        work = box.isend(message, 1, 0)
        dist.barrier()  # rank 1 takes it while this rank's thread sits here
        work.wait()
        del work  # a link drops its sends at its flush
    else:
        buffer = torch.empty_like(message)
        box.irecv(buffer, 0, 0).wait()
        dist.barrier()
        assert torch.equal(buffer, message)
    pipes = [side.pipe for side in (*box.incoming.values(), *box.outgoing.values())]
    freed = weakref.ref(box)
    del box
    gc.collect()
    time.sleep(0.01)  # the pusher's scan, if one was under way, lets go of it
    gc.collect()
    still_open = []
    for pipe in pipes:
        try:
            os.fstat(pipe)
            still_open.append(pipe)
        except OSError:
            pass
    return {"freed": freed() is None, "open": still_open}


def ending_peer_process(rank: int, init_file: str, out: str) -> None:
    """A pair started without the launcher (which would stop rank 1 as soon as rank 0
    ended): rank 0 ends once the pair is connected; rank 1 waits for a message from it
    and writes what its wait raised, and after how long."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    box = connect([1 - rank], timeout_s=30)
    dist.barrier()
    if rank == 0:
        os._exit(0)
    start = time.monotonic()
    try:
        box.irecv(torch.empty(4), 0, 1).wait()
        raised = ""
    except RuntimeError as error:
        raised = f"{type(error).__name__}: {error}"
    found = {"raised": raised, "seconds": time.monotonic() - start, "covered": box.covers(0)}
    with open(out, "w") as file:
        json.dump(found, file)
    os._exit(0)
