"""Whether this CPU computes bf16 natively, measured rather than guessed.

A CPU with AVX512-BF16 or AMX multiplies bf16 matrices faster than fp32 ones; one without
(AVX2 only, or AVX512 without its bf16 extension) has PyTorch convert every element, and a
bf16 run there takes several to tens of times as long as fp32.
``torch.backends.cpu.get_cpu_capability()`` says "AVX512" on CPUs with and without the
bf16 extension, and what PyTorch dispatches also depends on oneDNN's settings
(``ONEDNN_MAX_CPU_ISA``), so the honest answer is the one a short timed probe gives: the
cost a run will pay, whatever the reason.
"""

from __future__ import annotations

import time

import torch

__all__ = ["bf16_matmul_slowdown"]


def bf16_matmul_slowdown(size: int = 256, rows: int = 64, repeats: int = 5) -> float:
    """How many times an fp32 linear layer's time the same layer takes under bf16 autocast
    (what a ``--precision bf16`` forward runs) on one thread of this CPU; about 1 or below
    where bf16 is native.

    The best of ``repeats`` timings of each, alternated, so that a busy machine's pauses
    fall on both alike; a 64 x 256 by 256 x 256 product takes tens of microseconds in
    fp32. The global random stream and the thread count are left as they were.
    """
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, size, generator=generator)
    weight = torch.randn(size, size, generator=generator)
    bias = torch.randn(size, generator=generator)
    best = {True: float("inf"), False: float("inf")}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(repeats):
            for bf16 in best:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    start = time.perf_counter()
                    torch.nn.functional.linear(x, weight, bias)
                    best[bf16] = min(best[bf16], time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return best[True] / best[False]
