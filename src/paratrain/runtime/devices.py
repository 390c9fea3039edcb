"""Which device this worker computes on, and how much memory it has used at most."""

from __future__ import annotations

import resource
import sys

import torch
import torch.distributed as dist


def current_device() -> torch.device:
    """The worker's own GPU under NCCL, the CPU otherwise (gloo workers stand in for devices)."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def peak_memory_bytes(device: torch.device | None = None) -> int:
    """Peak memory of this worker: CUDA allocator peak on a GPU, peak resident set on CPU.

    The CPU figure is the whole process (interpreter and libraries included), which is
    what a user sizing a machine cares about; the per-category ledger is separate.
    """
    device = device or current_device()
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)
