"""Moving activations, their gradients and the step's loss between neighbouring stages.

Why receives are posted early: gloo moves a point-to-point message only once the receiver
has posted its receive, so a receive posted at the moment the data is needed costs a
round trip through both processes' communication threads, and on a loaded CPU that is
milliseconds. A stage knows its schedule, so it posts its receives ahead: the activations
of the next ``window`` micro-batches, and the gradient of each output as soon as the
output exists. Every message has its own tag (kind and micro-batch), so nothing depends on
two neighbours posting in the same order. Sends are non-blocking and kept alive until
``flush()``; every wait is bounded by the process group's timeout.

Shapes: the receiver must allocate before receiving. The first activation of every round
is preceded by a header (the value's structure, and each tensor's dtype and shape; see
``structure``) that all micro-batches of the round share, since they are equal splits of
one batch. So shapes may change from one step to the next (another sequence length, a
smaller last batch) at the cost of one small message per round. An activation may be a
tensor or a tuple/list/dict of tensors; each tensor travels as its own message. Gradients
need no header: the stage that receives a gradient produced its activation, and gradients
travel for its floating-point tensors only.

The round's first activation, posted before its header: a receive posted only once the
header has come is posted after the sender sent, the round trip above, on every round's
first pass (on a 2-stage mlp on 2 cores, that pass started a median 0.3 ms and a mean
0.7-1.6 ms after it could, against 0.1 ms for the round's other forwards; see
``benchmarks/pipeline_gaps.py``). So
where the last two headers of a link were equal, the receiver posts micro-batch 0 at the
round's start in the shapes of the last one. Both sides see the same headers, so both
know when it did: the sender of a header that differs then fills those receives with
zeros of the old shapes and sends micro-batch 0 under tags of their own (``_MOVED_TAGS``),
which the receiver posts once the header has told it; the next round posts nothing ahead
(its last two headers differ), so shapes that change every step cost no more than before.

Transport and buffers: neighbours on one host with CPU stages move their messages
through shared memory (``runtime.local_p2p``; ``PARATRAIN_P2P=gloo`` keeps gloo), the
others through the process group; the tags and the order above are the same for both.
Receive buffers are reused once nothing holds them (``receive_buffers``), so a receive
writes into warm pages rather than fresh ones.

Channels: with an interleaved schedule a worker holds several chunks, each with a link of
its own, and two workers exchange the messages of several chunks. Each side of a link
therefore has a channel (the index of the boundary between two virtual stages) that offsets
every tag, so the chunks' messages never meet; plain schedules use channel 0 on both sides.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from paratrain.parallel.pipeline.receive_buffers import ReceiveBuffers
from paratrain.parallel.pipeline.structure import (
    HEADER_BYTES,
    MAX_LEAVES,
    decode_header,
    encode_header,
    flatten,
    floating,
    unflatten,
)
from paratrain.runtime import comm
from paratrain.runtime.local_p2p import SharedMemoryP2P, finished

HEADER_TAG, LOSS_TAG = 1, 2
_ACTIVATION_TAGS, _GRADIENT_TAGS, _MOVED_TAGS = 1 << 20, 2 << 20, 3 << 20
CHANNEL_STRIDE = 4 << 20
"""Tags of one channel: room for every kind above, below the next channel's."""


def _tag(base: int, micro: int, leaf: int) -> int:
    """One tag per (kind, micro-batch, tensor of the value)."""
    return base + micro * MAX_LEAVES + leaf


class StageLink:
    """Point-to-point messages of one stage with the stage before and the stage after it."""

    def __init__(
        self,
        device: torch.device,
        *,
        prev_rank: int | None,
        next_rank: int | None,
        window: int,
        channels: tuple[int, int] = (0, 0),
        local: SharedMemoryP2P | None = None,
    ) -> None:
        """``channels``: the channel of the side towards ``prev_rank`` and of the side
        towards ``next_rank`` (see the module docstring); ``local``: the shared-memory
        connections of this worker's link set, used for the neighbours they cover."""
        self.device, self.prev_rank, self.next_rank = device, prev_rank, next_rank
        self._local = local
        self._buffers = ReceiveBuffers(device)
        self._prev_offset, self._next_offset = (c * CHANNEL_STRIDE for c in channels)
        self.window = max(1, window)
        self._sends: list[tuple[object, torch.Tensor]] = []
        self._activations: dict[int, list[tuple[object, torch.Tensor]]] = {}
        self._gradients: dict[int, list[tuple[object, torch.Tensor]]] = {}
        self._header: tuple[object, torch.Tensor] | None = None
        self._loss: tuple[object, torch.Tensor] | None = None
        self._shape: tuple[Any, list[tuple[torch.dtype, list[int]]]] | None = None
        self._micro_batches = 0
        self._next_to_post = 0
        self._received = HeaderHistory()
        self._sent = HeaderHistory()
        self._guessed = False  # this round's micro-batch 0 posted before its header
        self._first_tags = _ACTIVATION_TAGS  # micro-batch 0's tags this round (receiving)
        self._first_sent_tags = _ACTIVATION_TAGS  # the same, sending
        self.rounds_posted_ahead = 0
        """Rounds whose micro-batch 0 was posted before its header (for tests)."""
        self.guesses_missed = 0
        """Of those, rounds whose header then differed (their receives filled with zeros)."""

    # -- a round -------------------------------------------------------------------------

    def begin_round(self, micro_batches: int, *, expect_loss: bool) -> None:
        """Post what this round will surely receive first: the header, and the loss."""
        self._micro_batches, self._next_to_post, self._shape = micro_batches, 0, None
        self._first_tags, self._guessed = _ACTIVATION_TAGS, False
        self._buffers.new_round()
        if self.prev_rank is not None:
            header = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=self.device)
            tag = self._prev_offset + HEADER_TAG
            self._header = (self._irecv(header, None, self.prev_rank, tag), header)
            if self._received.steady and micro_batches > 0:
                self._shape, self._guessed = self._received.shape, True
                self._post_activations(upto=1)
                self.rounds_posted_ahead += 1
        if expect_loss and self.next_rank is not None:
            loss = torch.empty(1, device=self.device)
            tag = self._next_offset + LOSS_TAG
            self._loss = (self._irecv(loss, None, self.next_rank, tag), loss)

    # -- sending -------------------------------------------------------------------------

    def send_activation(self, value: Any, micro: int) -> None:
        """Send a stage's output: a tensor or a tuple/list/dict of tensors."""
        if micro == 0:
            self._send_header(value)
        base = self._first_sent_tags if micro == 0 else _ACTIVATION_TAGS
        leaves, _ = flatten(value)
        for index, leaf in enumerate(leaves):
            tag = self._next_offset + _tag(base, micro, index)
            self._isend(leaf.detach().contiguous(), self.next_rank, tag)

    def send_gradient(self, value: Any, micro: int) -> None:
        """Send the gradients of the floating-point tensors of a received activation (zeros
        for one the stage did not use)."""
        leaves, _ = flatten(value)
        for index in floating(leaves):
            leaf = leaves[index]
            grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            tag = self._prev_offset + _tag(_GRADIENT_TAGS, micro, index)
            self._isend(grad.detach().contiguous(), self.prev_rank, tag)

    def send_loss(self, value: torch.Tensor) -> None:
        loss = value.detach().reshape(1).float().clone()
        self._isend(loss, self.prev_rank, self._prev_offset + LOSS_TAG)

    # -- receiving -----------------------------------------------------------------------

    def recv_activation(self, micro: int) -> Any:
        if self._header is not None:
            self._read_header()
        self._post_activations(upto=micro + self.window)
        leaves = []
        for work, buffer in self._activations.pop(micro):
            if not finished(work):
                comm.wait(work, f"recv of activation {micro} from rank {self.prev_rank}")
            leaves.append(buffer)
        return unflatten(self._shape[0], leaves)

    def expect_gradient(self, micro: int, like: Any) -> None:
        """Post the receives of ``micro``'s output gradients as soon as the output exists."""
        leaves, _ = flatten(like)
        posted = []
        for index in floating(leaves):
            buffer, raw = self._buffers.take(leaves[index].shape, leaves[index].dtype)
            tag = self._next_offset + _tag(_GRADIENT_TAGS, micro, index)
            posted.append((self._irecv(buffer, raw, self.next_rank, tag), buffer))
        self._gradients[micro] = posted

    def recv_gradient(self, micro: int) -> list[torch.Tensor]:
        """The gradients of ``micro``'s output, one per floating-point tensor, in order."""
        grads = []
        for work, buffer in self._gradients.pop(micro):
            if not finished(work):
                comm.wait(work, f"recv of gradient {micro} from rank {self.next_rank}")
            grads.append(buffer)
        return grads

    def recv_loss(self) -> torch.Tensor:
        work, loss = self._loss
        comm.wait(work, f"recv of the step's loss from rank {self.next_rank}")
        self._loss = None
        return loss[0]

    def held_bytes(self) -> int:
        """Bytes of receive buffers posted or kept idle for reuse, and of sends not yet
        flushed (for the memory ledger)."""
        posted = [*self._sends]
        for entries in (*self._activations.values(), *self._gradients.values()):
            posted += entries
        held = sum(buffer.numel() * buffer.element_size() for _, buffer in posted)
        return held + self._buffers.idle_bytes()

    def flush(self) -> None:
        """Wait until every send has left (their buffers may then be reused)."""
        for work, _ in self._sends:
            if not finished(work):
                comm.wait(work, "send to a neighbouring stage")
        self._sends.clear()

    # -- internals -----------------------------------------------------------------------

    def _send_header(self, value: Any) -> None:
        """The round's header, and where the receiver posted micro-batch 0 in the last
        header's shapes and this one differs, zeros in those shapes to fill its receives
        (micro-batch 0 then goes under ``_MOVED_TAGS``)."""
        header = encode_header(value, self.device)
        self._isend(header, self.next_rank, self._next_offset + HEADER_TAG)
        guessed, old = self._sent.steady, self._sent.shape
        self._first_sent_tags = _ACTIVATION_TAGS
        if not self._sent.add(header) and guessed:
            for index, (dtype, shape) in enumerate(old[1]):
                filler = torch.zeros(shape, dtype=dtype, device=self.device)
                tag = self._next_offset + _tag(_ACTIVATION_TAGS, 0, index)
                self._isend(filler, self.next_rank, tag)
            self._first_sent_tags = _MOVED_TAGS

    def _read_header(self) -> None:
        """Wait for the round's header; where micro-batch 0 was posted ahead in other
        shapes, take the sender's zeros off those receives and post it again, moved."""
        work, header = self._header
        self._header = None
        comm.wait(work, f"recv of the activation header from rank {self.prev_rank}")
        same = self._received.add(header)
        if self._guessed and not same:
            for work, _ in self._activations.pop(0):
                comm.wait(work, f"recv of activation 0's zeros from rank {self.prev_rank}")
            self._next_to_post, self._first_tags = 0, _MOVED_TAGS
            self.guesses_missed += 1
        self._shape = self._received.shape

    def _post_activations(self, *, upto: int) -> None:
        _, leaves = self._shape
        while self._next_to_post < min(upto, self._micro_batches):
            micro = self._next_to_post
            base = self._first_tags if micro == 0 else _ACTIVATION_TAGS
            posted = []
            for index, (dtype, shape) in enumerate(leaves):
                buffer, raw = self._buffers.take(shape, dtype)
                tag = self._prev_offset + _tag(base, micro, index)
                posted.append((self._irecv(buffer, raw, self.prev_rank, tag), buffer))
            self._activations[micro] = posted
            self._next_to_post += 1

    def _local_for(self, peer: int) -> SharedMemoryP2P | None:
        """The shared-memory connections where they cover ``peer``, else None (gloo)."""
        return self._local if self._local is not None and self._local.covers(peer) else None

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        via = self._local_for(dst)
        self._sends.append((comm.send_async(tensor, dst=dst, tag=tag, via=via), tensor))

    def _irecv(self, buffer: torch.Tensor, raw: torch.Tensor | None, src: int, tag: int):
        """Post a receive into ``buffer`` (``raw``: its bytes, a flat uint8 view, which the
        shared-memory transport fills)."""
        local = self._local_for(src)
        if local is not None:
            return local.irecv(buffer if raw is None else raw, src, tag)
        return dist.irecv(buffer, src=src, tag=tag)


class HeaderHistory:
    """The headers one side of a link sent or received, as far as posting ahead needs:
    the last one, its shapes decoded, and whether it equalled the one before (``steady``:
    the next round's micro-batch 0 is posted before its header)."""

    def __init__(self) -> None:
        self.last: torch.Tensor | None = None
        self.shape: tuple[Any, list[tuple[torch.dtype, list[int]]]] | None = None
        self.steady = False

    def add(self, header: torch.Tensor) -> bool:
        """Record a round's header; True when it equals the last one."""
        same = self.last is not None and torch.equal(header, self.last)
        if not same:
            self.shape = decode_header(header)
        self.last, self.steady = header, same
        return same
