"""A one-way ring of frames in shared memory, between two processes on one host.

Why: gloo moves a point-to-point message through both processes' communication threads
(the receiver posts, the sender's thread answers, the receiver's thread reads, then wakes
the waiting thread), and each hand-off waits for the scheduler: on a loaded CPU a fed
pipeline pass started a median 0.13 ms after it could, most of it in ``irecv`` and
``wait`` (docs/benchmarks.md). Here the sender's own thread copies the bytes into a
mapped file and the receiver's own thread copies them out: no other thread, no round
trip, and a message that came before it is needed costs one copy.

Layout of the mapped file: the write position (bytes ever written, set by the writer
after the bytes it covers), the read position (bytes ever consumed, set by the reader),
each on its own cache line, then ``capacity`` bytes of frames. A frame is a 64-byte
header (tag, the whole message's bytes, this frame's bytes) and its payload, padded to
64 bytes; where a frame does not fit before the end, a wrap header sends the reader back
to the start. Positions are aligned 8-byte words read and written whole, and x86-64
keeps one core's stores in order as other cores see them, so the reader never sees a
position before the bytes it covers; other architectures are not offered this ring
(``supported``).

A frame holds at most a quarter of the ring, so that a message of any size moves: the
writer writes what fits and the rest as the reader frees room.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import struct
import uuid

HEADER = 64
"""Bytes of a frame's header, and the alignment of every frame."""
_DATA = 128
"""Where the frames start in the file, after the two positions' cache lines."""
_WRAP = -1
_HEADER_FORMAT = "qqq"


def supported() -> bool:
    """Whether this machine's memory order lets the ring publish positions as plain
    stores (x86-64's)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def _padded(nbytes: int) -> int:
    return (nbytes + HEADER - 1) // HEADER * HEADER


class Ring:
    """One direction of a connection: the writer's or the reader's side of a mapped file."""

    def __init__(self, path: str, capacity: int) -> None:
        """Map an existing ring file (``create`` makes one)."""
        self.path, self.capacity = path, capacity
        with open(path, "r+b") as file:
            populate = getattr(mmap, "MAP_POPULATE", 0)  # its pages mapped now, not on use
            self._map = mmap.mmap(file.fileno(), _DATA + capacity, flags=mmap.MAP_SHARED | populate)
        self._write = ctypes.c_int64.from_buffer(self._map, 0)
        self._read = ctypes.c_int64.from_buffer(self._map, HEADER)
        self._frames = ctypes.c_char.from_buffer(self._map, _DATA)
        self.address = ctypes.addressof(self._frames)
        """Where the frames start in this process's mapping: bytes are copied with
        ``ctypes.memmove`` (no torch storage over the ring: it is the transport's own
        memory, as gloo's and NCCL's buffers are theirs)."""
        self.max_frame = capacity // 4

    @staticmethod
    def create(directory: str, capacity: int) -> str:
        """A new ring file of ``capacity`` bytes, its memory reserved now (so a full
        tmpfs fails here with ENOSPC rather than later with SIGBUS); returns its path."""
        if capacity % HEADER or capacity < 16 * HEADER:
            raise ValueError(
                f"a ring's capacity must be a multiple of {HEADER} bytes, at least "
                f"{16 * HEADER}, not {capacity}."
            )
        path = os.path.join(directory, f"paratrain-ring-{uuid.uuid4().hex}")
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(descriptor, 0, _DATA + capacity)
        except OSError:
            os.close(descriptor)
            os.unlink(path)
            raise
        os.close(descriptor)
        return path

    # -- the writer's side ---------------------------------------------------------------

    def try_write(self, tag: int, message_bytes: int, source: int, nbytes: int) -> bool:
        """Append one frame (``nbytes`` at address ``source``, at most ``max_frame``) if it
        fits now; False, writing nothing, if the reader has not yet freed the room."""
        need = HEADER + _padded(nbytes)
        position = self._write.value
        offset = position % self.capacity
        to_end = self.capacity - offset
        wraps = to_end < need
        if self.capacity - (position - self._read.value) < need + (to_end if wraps else 0):
            return False
        if wraps:
            struct.pack_into(_HEADER_FORMAT, self._map, _DATA + offset, _WRAP, 0, 0)
            position, offset = position + to_end, 0
        struct.pack_into(_HEADER_FORMAT, self._map, _DATA + offset, tag, message_bytes, nbytes)
        if nbytes:
            ctypes.memmove(self.address + offset + HEADER, source, nbytes)
        self._write.value = position + need
        return True

    # -- the reader's side ---------------------------------------------------------------

    def peek(self) -> tuple[int, int, int, int] | None:
        """The next frame, unconsumed: (tag, the message's bytes, the address of its
        payload and its bytes, valid until ``consume``), or None if none was written."""
        position = self._read.value
        while position != self._write.value:
            offset = position % self.capacity
            tag, message_bytes, nbytes = struct.unpack_from(
                _HEADER_FORMAT, self._map, _DATA + offset
            )
            if tag == _WRAP:
                position += self.capacity - offset
                self._read.value = position
                continue
            return tag, message_bytes, self.address + offset + HEADER, nbytes
        return None

    def consume(self, nbytes: int) -> None:
        """Free the frame ``peek`` returned (its payload's ``nbytes``)."""
        self._read.value += HEADER + _padded(nbytes)

    def close(self) -> None:
        """Drop the mapping (its owner's last use of the ring)."""
        del self._frames, self._write, self._read
        self._map.close()
