"""What ``--elastic`` accepts, refused in one sentence before any worker starts.

Why so narrow: going on without a worker is exact only where every survivor holds the
whole model and optimizer state (dp) and the same global batch splits evenly over every
worker count the run may pass through. zero1-3 keep each optimizer shard once (zero3 each
parameter too), the pipeline and tensor splits each layer or stage once, so a dead worker
takes state with it that no survivor has; ps already goes on without a lost worker
(asynchronously, without ``--elastic``). For those, ``--max-restarts`` with
``--checkpoint-every`` is the way through a death; zero2 goes on under ``--elastic`` that
way too, at the survivors' count (``run/elastic_fallback``).
"""

from __future__ import annotations

import math

from paratrain.config import ConfigError, TrainConfig
from paratrain.parallel import strategy_class, strategy_names
from paratrain.runtime.external_job import in_external_job
from paratrain.runtime.launch import resolve_backend


def check_elastic(config: TrainConfig, devices: int) -> None:
    """Refuse an elastic run that could not go on exactly at every count it may reach."""
    if not config.elastic:
        if config.min_devices != 1:
            raise ConfigError("--min-devices applies to --elastic runs; add --elastic.")
        return
    elastic = [name for name in strategy_names() if strategy_class(name).elastic]
    fallback = [n for n in strategy_names() if strategy_class(n).elastic_from_checkpoint]
    if config.strategy not in elastic + fallback:
        raise ConfigError(
            f"--elastic works with strategy {' or '.join(elastic + fallback)} only: under "
            f"{config.strategy} a dead worker takes state no other worker holds; use "
            f"--strategy {elastic[0]}, or --max-restarts with --checkpoint-every to resume "
            "from the newest checkpoint."
        )
    described = strategy_class(config.strategy)
    copies = described.elastic_in_memory(config.strategy_options()) and not described.elastic
    if config.max_restarts and copies:
        raise ConfigError(
            f"--max-restarts under --elastic starts replacement workers, which {config.strategy} "
            "cannot yet hand its sharded state to; drop --max-restarts."
        )
    if getattr(config, "tensor", 1) not in (None, 1):
        raise ConfigError(
            "--elastic needs whole replicas, but --tensor splits layers over workers; "
            "drop --tensor."
        )
    if in_external_job():
        raise ConfigError(
            "--elastic is for local workers; under torchrun use its own --nnodes MIN:MAX "
            "with --max-restarts and --checkpoint-every."
        )
    if resolve_backend(config.backend, devices) == "nccl":
        raise ConfigError(
            "--elastic has run only on CPU workers over gloo so far (a dead GPU worker's "
            "NCCL communicator is not yet rebuilt); add --backend gloo, or use --max-restarts "
            "with --checkpoint-every on GPUs."
        )
    if config.precision == "fp16":
        raise ConfigError(
            "--elastic does not carry fp16's loss scale across a change of workers; use "
            "--precision bf16 or fp32."
        )
    if not 1 <= config.min_devices <= devices:
        raise ConfigError(
            f"--min-devices {config.min_devices} must be between 1 and the {devices} "
            "worker(s) started."
        )
    samples = config.global_batch // config.gradient_accumulation
    uneven = [n for n in range(config.min_devices, devices + 1) if samples % n]
    if config.global_batch % config.gradient_accumulation or uneven:
        need = _least_common_multiple(range(config.min_devices, devices + 1))
        raise ConfigError(
            f"--elastic splits the global batch over any count from {config.min_devices} to "
            f"{devices} workers, but the global batch {config.global_batch} over "
            f"{config.gradient_accumulation} micro-step(s) does not split evenly over "
            f"{', '.join(map(str, uneven)) or 'them'}; use a global batch that "
            f"is a multiple of {need * config.gradient_accumulation}, or a higher "
            "--min-devices."
        )


def _least_common_multiple(counts: range) -> int:
    return math.lcm(*counts)
