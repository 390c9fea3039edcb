"""The messages between workers and parameter servers, over gloo point-to-point.

Why a fixed header before every payload: gloo delivers a point-to-point message only
into a receive of exactly its size, so the receiver must know each size before posting.
Every request is a float64 header (operation, the worker's clock, the version it pulled,
samples, whether a pull is for a step (and so may look ahead, see ``lookahead.py``), the
byte length of a JSON payload, whether to wait for the other workers, whether
a push carries no gradient, the loss of the worker's share on a push, then one
has-gradient flag per parameter of that server's shard) followed by payloads whose sizes
both sides already know (the shard's flat tensors, one per dtype) or that the header
announces (JSON bytes).

A push that carries no gradient (``skipped``: the worker's fp16 gradients overflowed)
sends its header only. It still counts as the worker's step, so that no bound or
synchronous round waits for a gradient that will never come; what a server then does with
it is in ``server.py``.
Every reply is a float64 header (status, version, samples applied, JSON length, and on
the reply to a push in a plain synchronous round the round's mean loss over the global
batch and, where the run clips, the round's global gradient norm before clipping) and the
same kinds of payload. The one message between servers is a round's square norm of a
shard, when a synchronous run clips (``NORM_TAG``, see ``clipping.py``). float64 holds
integers exactly up to 2**53, far beyond any count.

With the shared-memory transport (see ``shared_memory.py``) a push's gradient and a pull's
parameters lie in regions both sides map instead of following the header; the headers
are the same and still order everything.

Ordering: on one pair of processes, messages with the same tag arrive in the order sent,
so a header and its payloads never interleave with another request's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from datetime import timedelta
from enum import IntEnum
from typing import Any

import torch

from paratrain.parallel.ps.sharding import ParamSpec

REQUEST_TAG, REQUEST_DATA_TAG, REPLY_TAG, REPLY_DATA_TAG = 11, 12, 13, 14
NORM_TAG = 15  # server to server: a round's square norm of a shard (see ps/clipping.py)
REQUEST_FIELDS = 9
LOOKAHEAD_FIELD = 4  # in a request header: 1.0 when a pull is for a step (see lookahead)
SKIPPED_FIELD = 7  # in a request header: 1.0 when a push carries no gradient
LOSS_FIELD = 8  # in a push's header: the mean loss of the worker's share
REPLY_FIELDS = 6
ROUND_LOSS_FIELD = 4  # in a plain synchronous push's reply: the round's global-batch loss
GRAD_NORM_FIELD = 5  # in the same reply, where the round was clipped: its norm before that


class Op(IntEnum):
    """What a worker asks of a server."""

    PULL = 1  # current parameters, once the staleness bound allows
    PUSH = 2  # gradients of one step
    SET = 3  # overwrite parameters (the initial ones, or load_state_dict)
    SAVE = 4  # write this shard of a checkpoint into a staging folder
    LOAD = 5  # load this shard from a checkpoint folder
    METRICS = 6  # push counts, rates, the staleness histogram
    DONE = 7  # this worker will push no more: stop waiting for it
    BYE = 8  # this worker is done talking (implies DONE)
    ATTACH = 9  # map this worker's shared-memory push and pull regions (see shared_memory)
    RATES = 10  # the learning rate of each parameter group, as the worker's optimizer has it


class Status(IntEnum):
    OK = 0
    ERROR = 1


class ShardLayout:
    """Packs a server's parameters (or their gradients) into one flat tensor per dtype."""

    def __init__(self, specs: Sequence[ParamSpec]) -> None:
        self.specs = list(specs)
        self.dtypes: list[torch.dtype] = []
        for spec in self.specs:
            if spec.dtype not in self.dtypes:
                self.dtypes.append(spec.dtype)
        self._slots: list[tuple[int, int]] = []  # (dtype index, offset)
        sizes = [0] * len(self.dtypes)
        for spec in self.specs:
            kind = self.dtypes.index(spec.dtype)
            self._slots.append((kind, sizes[kind]))
            sizes[kind] += spec.numel
        self.sizes = sizes

    @property
    def nbytes(self) -> int:
        return sum(spec.nbytes for spec in self.specs)

    def empty(self) -> list[torch.Tensor]:
        """Receive buffers for one packed message."""
        return [torch.empty(n, dtype=d) for n, d in zip(self.sizes, self.dtypes, strict=True)]

    def pack(
        self, tensors: Sequence[torch.Tensor | None], out: list[torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        """Flat CPU copies, in spec order; a ``None`` (no gradient) packs as zeros.

        ``out`` (from :meth:`empty`) is filled and returned instead of new tensors: a
        worker packs every step, and reusing one buffer spares a fresh allocation of the
        whole shard each time.
        """
        if out is None:
            out = self.empty()
        for spec, (kind, offset), tensor in zip(self.specs, self._slots, tensors, strict=True):
            slot = out[kind][offset : offset + spec.numel]
            if tensor is None:
                slot.zero_()
            else:
                slot.copy_(tensor.detach().reshape(-1))
        return out

    def views(self, flats: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each parameter's view into received flat tensors, shaped, in spec order."""
        return [
            flats[kind][offset : offset + spec.numel].view(spec.shape)
            for spec, (kind, offset) in zip(self.specs, self._slots, strict=True)
        ]


def request_header(
    op: Op,
    *,
    flags: int,
    clock: int = 0,
    pulled: int = 0,
    samples: int = 0,
    json_bytes: int = 0,
    wait: bool = False,
    skipped: bool = False,
    lookahead: bool = False,
    loss: float = 0.0,
    has_grad: Sequence[bool] = (),
) -> torch.Tensor:
    """A request header; ``flags`` is the shard's parameter count (its has-grad slots)."""
    header = torch.zeros(REQUEST_FIELDS + flags, dtype=torch.float64)
    header[:REQUEST_FIELDS] = torch.tensor(
        [
            float(op),
            clock,
            pulled,
            samples,
            float(lookahead),
            json_bytes,
            float(wait),
            float(skipped),
            loss,
        ],
        dtype=torch.float64,
    )
    if has_grad:
        header[REQUEST_FIELDS:] = torch.tensor([1.0 if g else 0.0 for g in has_grad])
    return header


def reply_header(
    status: Status = Status.OK,
    *,
    version: int = 0,
    samples: int = 0,
    json_bytes: int = 0,
    loss: float = 0.0,
    grad_norm: float = 0.0,
) -> torch.Tensor:
    return torch.tensor(
        [float(status), version, samples, json_bytes, loss, grad_norm], dtype=torch.float64
    )


def encode_json(value: Any) -> torch.Tensor:
    """JSON as a uint8 tensor (the payload of SAVE, LOAD, METRICS and errors)."""
    return torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)


def decode_json(tensor: torch.Tensor) -> Any:
    return json.loads(bytes(tensor.tolist()).decode())


def error_value(server: int, error: Exception) -> dict[str, Any]:
    """The JSON a server answers a failed request with; an ``OSError`` (a full disk while
    writing its shard) keeps its ``errno``, so the worker can tell a disk's refusal apart
    from a fault and say it as every engine does."""
    value: dict[str, Any] = {"error": f"parameter server {server}: {error}"}
    if isinstance(error, OSError) and error.errno is not None:
        value["errno"] = error.errno
    return value


def reply_error(value: dict[str, Any]) -> Exception:
    """What a worker raises for a server's error reply: the ``OSError`` it was where the
    server said its ``errno``, else a ``RuntimeError`` with the server's words."""
    if value.get("errno") is None:
        return RuntimeError(value["error"])
    code = int(value["errno"])
    error = OSError(code, os.strerror(code))
    error.__cause__ = RuntimeError(value["error"])  # which server, in the traceback
    return error


def send_all(group, tensors: Sequence[torch.Tensor], dst: int, tag: int, timeout: timedelta | None):
    """Send ``tensors`` in order and wait until gloo has taken each."""
    wait_all([group.send([t], dst, tag) for t in tensors], timeout)


def post_recv(group, tensors: Sequence[torch.Tensor], src: int, tag: int) -> list:
    """Post receives for ``tensors`` (in order) without waiting."""
    return [group.recv([t], src, tag) for t in tensors]


def wait_all(works: Sequence, timeout: timedelta | None) -> None:
    """Wait for each operation, at most ``timeout`` (a worker: the job's timeout).

    ``None`` waits as long as the group's own deadline allows; only servers do that, and
    their life is bounded by the job instead (see ``server.py``).
    """
    for work in works:
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout)
