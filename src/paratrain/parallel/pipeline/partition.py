"""Splitting a layer list into contiguous pipeline stages: checks and exact balancing.

A pipeline runs as fast as its slowest stage and needs as much memory as its fullest one,
so balancing minimizes the largest per-stage cost. The split is exact (not a heuristic):
costs are turned into integers without rounding and the optimal bottleneck is found by
binary search over integers, so the answer does not depend on float summation order.

Everything here is pure and needs no torch; ``LayerProfile`` (from ``layer_profile``) is
only read for its numbers.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable, Sequence
from fractions import Fraction
from itertools import accumulate
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from paratrain.parallel.layer_profile import LayerProfile

__all__ = [
    "COST_CHOICES",
    "PartitionError",
    "balance_by_cost",
    "check_stages",
    "layer_costs",
    "partition",
    "stage_bounds",
    "validate_balance",
]


class PartitionError(ValueError):
    """A pipeline split that cannot work, explained in one sentence that says what to change."""


def _layers(count: int) -> str:
    return f"{count} layer" if count == 1 else f"{count} layers"


def check_stages(layers: int, stages: int) -> None:
    """Refuse a stage count that cannot give every stage at least one layer."""
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise PartitionError(f"a pipeline needs at least 1 stage, not {stages!r}; use 1 or more.")
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise PartitionError(
            f"the model has {layers!r} layers, so there is nothing to split; "
            "give a model with at least one layer."
        )
    if stages > layers:
        raise PartitionError(
            f"the model has {_layers(layers)}, so it cannot be split into {stages} stages; "
            f"use at most {layers} stages or a model with more layers."
        )


def validate_balance(balance: Sequence[int], *, layers: int, stages: int) -> list[int]:
    """Return ``balance`` as a list after checking it gives ``stages`` stages of ``layers``.

    A balance is the number of consecutive layers on each stage, first stage first.
    """
    check_stages(layers, stages)
    entries = list(balance)
    if len(entries) != stages:
        raise PartitionError(
            f"balance {entries} has {len(entries)} entries but the pipeline has {stages} stages; "
            f"give one layer count per stage ({stages} entries)."
        )
    for stage, count in enumerate(entries):
        if isinstance(count, bool) or not isinstance(count, int):
            raise PartitionError(
                f"balance {entries} has {count!r} for stage {stage}; "
                "every entry must be a whole number of layers."
            )
        if count < 1:
            raise PartitionError(
                f"balance {entries} gives stage {stage} {count} layers; "
                "every stage needs at least 1 layer."
            )
    covered = sum(entries)
    if covered != layers:
        raise PartitionError(
            f"balance {entries} covers {covered} layers but the model has {layers}; "
            f"make the entries add up to {layers}."
        )
    return entries


def stage_bounds(balance: Sequence[int]) -> list[tuple[int, int]]:
    """Half-open ``(start, end)`` layer indices per stage: ``[2, 3]`` -> ``[(0, 2), (2, 5)]``."""
    ends = list(accumulate(balance))
    return [(end - count, end) for count, end in zip(balance, ends, strict=True)]


def _exact_integers(costs: Sequence[float]) -> list[int]:
    """Scale the costs by one common factor so they become integers, without rounding.

    Every finite float is a dyadic rational, so a common power-of-two denominator exists;
    integer sums are then exact and comparisons cannot be flipped by rounding.
    """
    fractions: list[Fraction] = []
    for index, cost in enumerate(costs):
        if isinstance(cost, bool) or not isinstance(cost, (int, float)):
            raise PartitionError(f"layer {index} has cost {cost!r}; costs must be numbers.")
        if not math.isfinite(cost) or cost < 0:
            raise PartitionError(
                f"layer {index} has cost {cost!r}; costs must be finite and not negative."
            )
        fractions.append(Fraction(cost))
    denominator = math.lcm(*(f.denominator for f in fractions))
    return [int(f * denominator) for f in fractions]


def _fits(prefix: list[int], start: int, stages: int, bound: int) -> bool:
    """Whether layers ``start:`` split into at most ``stages`` groups each costing <= bound.

    ``prefix[i]`` is the cost of the first ``i`` layers. Greedy (each group as long as the
    bound allows) uses the fewest groups; splitting a group further never raises the
    maximum, so "at most" equals "exactly" whenever enough layers remain.
    """
    layers = len(prefix) - 1
    for _ in range(stages):
        if start == layers:
            return True
        start = bisect_right(prefix, prefix[start] + bound) - 1
    return start == layers


def balance_by_cost(costs: Sequence[float], stages: int) -> list[int]:
    """Split per-layer ``costs`` into ``stages`` contiguous non-empty groups, exactly.

    The result minimizes the largest group cost. Among the optimal splits it returns the
    one whose earlier stages are as large as possible (the lexicographically largest
    balance): the last stage also computes the loss, which no per-layer cost includes,
    so a tie is broken by leaving the later stages lighter. The rule also makes the answer
    deterministic, e.g. equal costs ``[1, 1, 1, 1, 1]`` over 2 stages give ``[3, 2]``.
    """
    check_stages(len(costs), stages)
    scaled = _exact_integers(costs)
    prefix = [0, *accumulate(scaled)]
    total = prefix[-1]
    low = max(max(scaled), -(-total // stages))  # no split can do better than either
    high = total
    while low < high:  # smallest integer bound that fits; the optimum is a group sum
        middle = (low + high) // 2
        if _fits(prefix, 0, stages, middle):
            high = middle
        else:
            low = middle + 1
    bound = low

    layers = len(scaled)
    balance: list[int] = []
    start = 0
    for stage in range(stages - 1):
        later = stages - stage - 1
        # As many layers as the bound allows, leaving one per later stage. The suffix
        # after the longest such group needs no more groups than any shorter choice.
        end = min(bisect_right(prefix, prefix[start] + bound) - 1, layers - later)
        balance.append(end - start)
        start = end
    balance.append(layers - start)
    return balance


COST_CHOICES: tuple[str, ...] = ("params", "time", "memory")


def layer_costs(
    costs_by: str,
    profiles: Sequence[LayerProfile],
    *,
    optimizer_bytes_per_param: float = 8.0,
) -> list[float]:
    """The cost of each layer under ``costs_by``, as ``partition`` balances it.

    ``"params"``: parameter bytes. ``"time"``: measured forward+backward seconds.
    ``"memory"``: parameters + gradients (same bytes as the parameters) + optimizer state
    (``optimizer_bytes_per_param`` per parameter; 8 for Adam's two fp32 moments) + the
    activations autograd saves for backward for one sample input. Frozen parameters are
    counted as trainable, which overestimates rather than risks running out of memory.
    """
    if costs_by not in COST_CHOICES:
        raise PartitionError(
            f"unknown partition cost {costs_by!r}; choose one of {', '.join(COST_CHOICES)}."
        )
    if not math.isfinite(optimizer_bytes_per_param) or optimizer_bytes_per_param < 0:
        raise PartitionError(
            f"optimizer_bytes_per_param must be a finite number >= 0, "
            f"not {optimizer_bytes_per_param!r}; use 8 for Adam in fp32, 0 for plain SGD."
        )
    measured = any(p.forward_backward_s > 0 for p in profiles)
    if costs_by in ("time", "memory") and profiles and not measured:
        raise PartitionError(
            f"balancing by {costs_by!r} needs measured profiles, but these hold parameter "
            "counts only; build them with profile_layers(layers, sample_input) or balance "
            "by 'params'."
        )
    cost_of: dict[str, Callable[[LayerProfile], float]] = {
        "params": lambda p: p.param_bytes,
        "time": lambda p: p.forward_backward_s,
        "memory": lambda p: (
            2 * p.param_bytes + optimizer_bytes_per_param * p.param_count + p.activation_bytes
        ),
    }
    return [cost_of[costs_by](profile) for profile in profiles]


def partition(
    costs_by: str,
    profiles: Sequence[LayerProfile],
    stages: int,
    *,
    optimizer_bytes_per_param: float = 8.0,
) -> list[int]:
    """Balance (layers per stage) for ``profiles`` over ``stages`` by the chosen cost.

    See ``layer_costs`` for what each choice measures and ``balance_by_cost`` for the
    exact split and its tie rule.
    """
    costs = layer_costs(costs_by, profiles, optimizer_bytes_per_param=optimizer_bytes_per_param)
    return balance_by_cost(costs, stages)
