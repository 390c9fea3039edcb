"""Moving activations and their gradients between neighbouring pipeline stages.

Sends are non-blocking (``isend``) and kept alive until ``flush()``; receives block
(bounded by the process group's timeout). Messages between two stages are matched in
the order they were posted, so both sides only need to agree on the order of micro-batches.

Shapes: the receiver must allocate before receiving. The first activation of every round
is preceded by a small header (dtype and shape); all micro-batches of a round share it,
because they are equal splits of one batch. So shapes may change from one step to the
next (another sequence length, a smaller last batch) at the cost of one tiny message per
round and link; gradients need no header, since the stage that receives a gradient
produced the activation it belongs to.
"""

from __future__ import annotations

import torch

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
    """Point-to-point messages of one stage with its neighbours."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pending: list[tuple[object, torch.Tensor]] = []
        self._incoming: tuple[torch.dtype, tuple[int, ...]] | None = None

    def send(self, tensor: torch.Tensor, *, dst: int, header: bool = False) -> None:
        tensor = tensor.detach().contiguous()
        if header:
            encoded = encode_header(tensor).to(self.device)
            self._pending.append((comm.send_async(encoded, dst=dst), encoded))
        self._pending.append((comm.send_async(tensor, dst=dst), tensor))

    def recv_activation(self, *, src: int, header: bool) -> torch.Tensor:
        if header or self._incoming is None:
            encoded = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.device)
            self._incoming = decode_header(comm.recv_into(encoded, src=src))
        dtype, shape = self._incoming
        return comm.recv_into(torch.empty(shape, dtype=dtype, device=self.device), src=src)

    def recv_like(self, reference: torch.Tensor, *, src: int) -> torch.Tensor:
        return comm.recv_into(torch.empty_like(reference), src=src)

    def flush(self) -> None:
        """Wait until every send has left (their buffers may then be reused)."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
