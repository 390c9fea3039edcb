"""Which device this worker computes on, and how much memory it has used at most."""

from __future__ import annotations

import resource
import sys

import torch
import torch.distributed as dist


def process_group_backend(backend: str) -> str:
    """What ``init_process_group`` is given for a resolved backend. NCCL moves CUDA tensors
    only, and the engines also exchange small CPU tensors (random-number seeds, step
    counters, objects): a group of NCCL alone refuses those ("No backend type associated
    with device type cpu", seen on an H200 with torch 2.11), so CUDA jobs pair it with gloo
    for CPU tensors, as torch documents for mixed-device groups."""
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def on_cuda(group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``group`` (the whole job by default) moves CUDA tensors over NCCL."""
    return "nccl" in str(dist.get_backend(group))


def current_device() -> torch.device:
    """The worker's own GPU under NCCL, the CPU otherwise (gloo workers stand in for devices)."""
    if dist.is_available() and dist.is_initialized() and on_cuda():
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
