"""Replicas' buffers (BatchNorm running statistics) made equal to the first replica's.

Why: a training forward updates each replica's running statistics from its own share of
the batch only, so replicas drift apart, and evaluation (each replica's share through its
own statistics) and the saved state would differ from what torch's
``DistributedDataParallel`` gives by default (``broadcast_buffers=True``). We follow DDP.

When DDP sends them: before a forward, if the module's previous forward was a
gradient-synchronising training forward (or there was none). In the loops DDP users
write (one forward per step, or ``no_sync()`` for all but the last micro-batch, and
evaluation under ``no_grad``), that is the first training forward of each step and the
first evaluation forward after training. Evaluation forwards change no buffers, so the
values every replica holds are the same if we send them once per step, before the first
micro-batch's forward, and before an evaluation, each time only if a training forward ran
since the last send: what ``BufferBroadcast.before_forward`` does.

``broadcast_buffers=False`` keeps DDP's other behaviour: buffers are made equal once, at
setup, and then each replica keeps its own (the first replica's are the ones saved).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup

from paratrain.parallel.options import StrategyOption
from paratrain.runtime import comm

BROADCAST_BUFFERS = StrategyOption(
    "broadcast_buffers",
    bool,
    True,
    "send the first replica's buffers (BatchNorm running statistics) to the others before "
    "each step's forward, as DDP does",
)
"""The option of every replica engine (dp, zero1-3); one meaning for all."""


class BufferBroadcast:
    """Sends ``buffers`` from the group's first member to the others when they may differ.

    Every replica calls ``before_forward`` at the same points (each ``train_step`` and
    ``eval_step``), so all of them take part in the same broadcasts.
    """

    def __init__(self, buffers: list[torch.Tensor], *, group: ProcessGroup | None) -> None:
        self.buffers = buffers
        self.group = group
        self._stale = False  # the engine broadcasts everything once at setup

    def before_forward(self, *, training: bool) -> None:
        """Call before a step's first forward (``training=True``) or an evaluation."""
        if self._stale:
            comm.broadcast_tensors(self.buffers, src=0, group=self.group)
            self._stale = False
        if training:
            self._stale = True  # this forward updates the buffers on each replica


def buffer_broadcast(
    model: nn.Module,
    *,
    group: ProcessGroup | None,
    enabled: bool,
    skip: tuple[type[nn.Module], ...] = (),
) -> BufferBroadcast | None:
    """The broadcaster for ``model``'s buffers, or None where there is nothing to send.

    Buffers of modules of the ``skip`` types are left out (synchronised BatchNorm computes
    the same statistics on every replica, so its buffers never differ).
    """
    if not enabled or comm.world_size(group) == 1:
        return None
    buffers = list(
        dict.fromkeys(  # a buffer two modules share is sent once
            buffer
            for module in model.modules()
            if not isinstance(module, skip)
            for buffer in module.buffers(recurse=False)
        )
    )
    return BufferBroadcast(buffers, group=group) if buffers else None
