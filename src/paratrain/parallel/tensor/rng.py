"""One random stream per tensor group: its workers draw the same numbers.

The activations outside the split layers (the residual stream, a rowwise layer's summed
output) are replicated: every worker of a tensor group must compute them identically, so
a dropout there must draw the same mask on each, or the copies drift apart silently. So
the group's first worker's generator state is sent to the others at setup and after a
checkpoint is loaded (a checkpoint from another layout may give the ranks different
streams). The first worker keeps its own stream, so tp draws what the single-device
engine draws after the same seeding.

Dropout inside a split region (on a colwise layer's output) then draws, on each worker,
the numbers of that same stream for its own slice: the masks of different slices are
correlated (Megatron keeps a second, per-rank stream for this; not done yet), which keeps
dropout's expectation but not the single-device engine's exact masks.
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from paratrain.runtime import comm


def share_stream(device: torch.device, *, group: ProcessGroup | None = None) -> None:
    """Give every member of ``group`` its first member's CPU (and GPU) generator state."""
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    comm.broadcast_tensors(states, src=0, group=group)
    torch.set_rng_state(states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1], device)
