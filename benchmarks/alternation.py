"""Timing two implementations fairly on a noisy machine: alternate them, take medians.

Both benchmark scripts build paratrain and its peer in the same worker processes and run
them round by round on the same batches, swapping the order every round, so that whatever
else the machine is doing hits both alike. Each configuration is launched several times;
the figures are medians over steps, then over launches.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch.distributed as dist


class Runner(Protocol):
    def step(self, inputs: Any, targets: Any) -> None: ...


def median_step_times(
    runners: Mapping[str, Runner], batches: Sequence[tuple], *, rounds: int, warmup: int
) -> dict[str, float]:
    """This rank's median seconds per step for each runner."""
    for runner in runners.values():
        for inputs, targets in batches[:warmup]:
            runner.step(inputs, targets)
    times: dict[str, list[float]] = {key: [] for key in runners}
    for round_index in range(rounds):
        order = list(runners) if round_index % 2 == 0 else list(reversed(list(runners)))
        for key in order:
            dist.barrier()
            for inputs, targets in batches:
                start = time.perf_counter()
                runners[key].step(inputs, targets)
                times[key].append(time.perf_counter() - start)
    return {key: statistics.median(values) for key, values in times.items()}


def slowest_rank(results: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """A synchronous step ends when its slowest rank ends: the max over ranks."""
    return {key: max(result[key] for result in results) for key in results[0]}


def over_launches(
    launches: Sequence[Mapping[str, float]], *, ours: str, peer: str
) -> tuple[dict[str, float], list[float]]:
    """Median step time per runner over launches, and each launch's ``peer / ours`` ratio."""
    median = {key: statistics.median(run[key] for run in launches) for key in launches[0]}
    ratios = [run[peer] / run[ours] for run in launches]
    return median, ratios
