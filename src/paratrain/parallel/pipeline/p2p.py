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
is preceded by a small header (dtype and shape) that all micro-batches of the round share,
since they are equal splits of one batch. So shapes may change from one step to the next
(another sequence length, a smaller last batch) at the cost of one tiny message per round.
Gradients need no header: the stage that receives a gradient produced its activation.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from paratrain.runtime import comm

_HEADER_LEN = 10
_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
HEADER_TAG, LOSS_TAG = 1, 2
_ACTIVATION_TAGS, _GRADIENT_TAGS = 1 << 20, 2 << 20


def encode_header(tensor: torch.Tensor) -> torch.Tensor:
    """dtype code, ndim, then the shape, zero-padded to a fixed length."""
    if tensor.dtype not in _DTYPES:
        raise TypeError(f"pipeline stages cannot pass tensors of dtype {tensor.dtype}.")
    if tensor.dim() > _HEADER_LEN - 2:
        raise ValueError(f"pipeline activations may have at most {_HEADER_LEN - 2} dimensions.")
    values = [_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
    return torch.tensor(values + [0] * (_HEADER_LEN - len(values)), dtype=torch.int64)


def decode_header(header: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...]]:
    values = header.tolist()
    return _DTYPES[values[0]], tuple(values[2 : 2 + values[1]])


class StageLink:
    """Point-to-point messages of one stage with the stage before and the stage after it."""

    def __init__(
        self, device: torch.device, *, prev_rank: int | None, next_rank: int | None, window: int
    ) -> None:
        self.device, self.prev_rank, self.next_rank = device, prev_rank, next_rank
        self.window = max(1, window)
        self._sends: list[tuple[object, torch.Tensor]] = []
        self._activations: dict[int, tuple[object, torch.Tensor]] = {}
        self._gradients: dict[int, tuple[object, torch.Tensor]] = {}
        self._header: tuple[object, torch.Tensor] | None = None
        self._loss: tuple[object, torch.Tensor] | None = None
        self._shape: tuple[torch.dtype, tuple[int, ...]] | None = None
        self._micro_batches = 0
        self._next_to_post = 0

    # -- a round -------------------------------------------------------------------------

    def begin_round(self, micro_batches: int, *, expect_loss: bool) -> None:
        """Post what this round will surely receive first: the header, and the loss."""
        self._micro_batches, self._next_to_post, self._shape = micro_batches, 0, None
        if self.prev_rank is not None:
            header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.device)
            self._header = (self._irecv(header, self.prev_rank, HEADER_TAG), header)
        if expect_loss and self.next_rank is not None:
            loss = torch.empty(1, device=self.device)
            self._loss = (self._irecv(loss, self.next_rank, LOSS_TAG), loss)

    # -- sending -------------------------------------------------------------------------

    def send_activation(self, tensor: torch.Tensor, micro: int) -> None:
        tensor = tensor.detach().contiguous()
        if micro == 0:
            self._isend(encode_header(tensor).to(self.device), self.next_rank, HEADER_TAG)
        self._isend(tensor, self.next_rank, _ACTIVATION_TAGS + micro)

    def send_gradient(self, tensor: torch.Tensor, micro: int) -> None:
        self._isend(tensor.detach().contiguous(), self.prev_rank, _GRADIENT_TAGS + micro)

    def send_loss(self, value: torch.Tensor) -> None:
        self._isend(value.detach().reshape(1).float().clone(), self.prev_rank, LOSS_TAG)

    # -- receiving -----------------------------------------------------------------------

    def recv_activation(self, micro: int) -> torch.Tensor:
        if self._shape is None:
            work, header = self._header
            comm.wait(work, f"recv of the activation header from rank {self.prev_rank}")
            self._shape = decode_header(header)
        self._post_activations(upto=micro + self.window)
        work, buffer = self._activations.pop(micro)
        comm.wait(work, f"recv of activation {micro} from rank {self.prev_rank}")
        return buffer

    def expect_gradient(self, micro: int, like: torch.Tensor) -> None:
        """Post the receive of ``micro``'s output gradient as soon as the output exists."""
        buffer = torch.empty_like(like)
        self._gradients[micro] = (
            self._irecv(buffer, self.next_rank, _GRADIENT_TAGS + micro),
            buffer,
        )

    def recv_gradient(self, micro: int) -> torch.Tensor:
        work, buffer = self._gradients.pop(micro)
        comm.wait(work, f"recv of gradient {micro} from rank {self.next_rank}")
        return buffer

    def recv_loss(self) -> torch.Tensor:
        work, loss = self._loss
        comm.wait(work, f"recv of the step's loss from rank {self.next_rank}")
        self._loss = None
        return loss[0]

    def held_bytes(self) -> int:
        """Bytes of receive buffers posted and sends not yet flushed (for the memory ledger)."""
        posted = [*self._activations.values(), *self._gradients.values(), *self._sends]
        return sum(buffer.numel() * buffer.element_size() for _, buffer in posted)

    def flush(self) -> None:
        """Wait until every send has left (their buffers may then be reused)."""
        for work, _ in self._sends:
            comm.wait(work, "send to a neighbouring stage")
        self._sends.clear()

    # -- internals -----------------------------------------------------------------------

    def _post_activations(self, *, upto: int) -> None:
        dtype, shape = self._shape
        while self._next_to_post < min(upto, self._micro_batches):
            micro = self._next_to_post
            buffer = torch.empty(shape, dtype=dtype, device=self.device)
            work = self._irecv(buffer, self.prev_rank, _ACTIVATION_TAGS + micro)
            self._activations[micro] = (work, buffer)
            self._next_to_post += 1

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        self._sends.append((comm.send_async(tensor, dst=dst, tag=tag), tensor))

    @staticmethod
    def _irecv(buffer: torch.Tensor, src: int, tag: int):
        return dist.irecv(buffer, src=src, tag=tag)
