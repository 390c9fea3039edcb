"""The line a bf16 run on a CPU without native bf16 prints before it starts.

Such a run is correct but slow: every bf16 matrix product is emulated (a sharded gpt run
once trained at 10 samples/s in bf16 with no word). The user chose bf16 for speed or
memory, so the run goes on as asked; it says once, in the parent (rank 0 under torchrun),
what it costs here and which flag runs faster. Whether bf16 is native is measured
(``runtime/cpu_bf16``).
"""

from __future__ import annotations

from collections.abc import Callable

from paratrain.config import TrainConfig
from paratrain.runtime.cpu_bf16 import bf16_matmul_slowdown
from paratrain.runtime.devices import current_device
from paratrain.runtime.launch import in_external_job, resolve_backend

SLOW = 2.0
"""A bf16 product taking this many times an fp32 one is worth a line: native bf16 takes
at most about as long (a third as long with AMX); emulated bf16 measured 4x (AVX512
without its bf16 extension) to 40-65x (AVX2) on one machine with oneDNN held to each."""


def bf16_notice(
    config: TrainConfig, devices: int, slowdown: Callable[[], float] | None = None
) -> str | None:
    """One line where ``--precision bf16`` runs on CPU workers whose CPU emulates bf16;
    None otherwise (fp32, fp16, GPUs, or a CPU with native bf16). ``slowdown``: the probe
    (``bf16_matmul_slowdown`` when None)."""
    if config.precision != "bf16" or not _computes_on_cpu(config, devices):
        return None
    factor = (slowdown or bf16_matmul_slowdown)()
    if factor < SLOW:
        return None
    return (
        f"paratrain: warning: this CPU has no native bf16 (a bf16 matrix product takes "
        f"{factor:.0f}x as long as an fp32 one here), so --precision bf16 runs several times "
        "slower than fp32; pass --precision fp32 to train faster on this machine."
    )


def _computes_on_cpu(config: TrainConfig, devices: int) -> bool:
    """Whether the workers compute on the CPU: gloo workers (under torchrun, this rank's
    device, the job's group being joined by now)."""
    if in_external_job():
        return current_device().type == "cpu"
    return resolve_backend(config.backend, devices) == "gloo"
