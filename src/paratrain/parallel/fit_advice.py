"""Which strategy would fit a model into a per-worker memory budget (the ZeRO arithmetic).

With fp32 weights and Adam, training holds per parameter 4 bytes of weight, 4 of gradient
and 8 of optimizer state (two moments): 16 bytes. Strategies differ in how much of that
each of N workers keeps (Rajbhandari et al., "ZeRO", 2020):

    dp        4 + 4 + 8          every replica holds everything
    zero1     4 + 4 + 8/N        optimizer state sharded
    zero2     4 + (4 + 8)/N      gradients too
    zero3     (4 + 4 + 8)/N      parameters too
    pipeline  (4 + 4 + 8)/N      each of N stages holds its layers (if they balance)

Activations are added as measured on the worker that ran out (a replica's share of the
batch is the same under dp and ZeRO; a pipeline stage holds a different mix, so this is
an estimate there). Communication buffers are left out. The advice names the
*least-sharded* strategy that fits, because each step of sharding costs communication.
"""

from __future__ import annotations

from collections.abc import Iterable

from paratrain.runtime.units import format_bytes

ORDER = ("dp", "zero1", "zero2", "zero3", "pipeline")
"""Strategies from least to most sharded (zero3 before pipeline: it needs no layer list)."""


def model_state_per_worker(
    strategy: str,
    parameters: int,
    workers: int,
    *,
    weight: int = 4,
    gradient: int = 4,
    optimizer: int = 8,
) -> float | None:
    """Bytes of weights, gradients and optimizer state one worker holds; None if unknown."""
    n = max(1, workers)
    per_parameter = {
        "single": weight + gradient + optimizer,
        "dp": weight + gradient + optimizer,
        "zero1": weight + gradient + optimizer / n,
        "zero2": weight + (gradient + optimizer) / n,
        "zero3": (weight + gradient + optimizer) / n,
        "pipeline": (weight + gradient + optimizer) / n,
    }.get(strategy)
    return None if per_parameter is None else per_parameter * parameters


def parameter_share(strategy: str, *, workers: int, stages: int = 1) -> float | None:
    """The smallest share of the parameters one worker holds under ``strategy``.

    For refusing a budget before any worker starts: a pipeline stage holds at least
    1/stages of the model only if the layers balance, so this is a lower bound there.
    None for strategies this module does not know.
    """
    if strategy in ("single", "dp", "zero1", "zero2"):
        return 1.0
    if strategy == "zero3":
        return 1.0 / max(1, workers)
    if strategy == "pipeline":
        return 1.0 / max(1, stages)
    return None


def fitting_strategy(
    *,
    parameters: int,
    workers: int,
    budget: int,
    activations: int = 0,
    candidates: Iterable[str] = ORDER,
    exclude: Iterable[str] = (),
) -> str | None:
    """The least-sharded candidate whose per-worker need fits ``budget``, or None."""
    allowed = set(candidates) - set(exclude)
    for strategy in ORDER:
        if strategy not in allowed:
            continue
        need = model_state_per_worker(strategy, parameters, workers)
        if need is not None and need + activations <= budget:
            return strategy
    return None


def advice(
    *,
    parameters: int,
    workers: int,
    budget: int,
    activations: int = 0,
    candidates: Iterable[str] = ORDER,
    current: str | None = None,
) -> str:
    """A clause for an out-of-memory message: what would fit, or that nothing does."""
    candidates = list(candidates)
    choice = fitting_strategy(
        parameters=parameters,
        workers=workers,
        budget=budget,
        activations=activations,
        candidates=candidates,
        exclude=(current,) if current else (),
    )
    basis = f"{parameters:,} fp32 parameters with Adam over {workers} worker(s)"
    included = ", activations included" if activations else ""
    if choice is not None:
        need = model_state_per_worker(choice, parameters, workers) + activations
        return (
            f"strategy {choice!r} would fit ({basis}: about {format_bytes(need)} per "
            f"worker{included})"
        )
    sharded = [s for s in ("zero3", "pipeline") if s in candidates] or ["a fully sharded one"]
    least = model_state_per_worker("zero3", parameters, workers) + activations
    return (
        f"no strategy fits ({basis}: even {' or '.join(sharded)} needs about "
        f"{format_bytes(least)} per worker{included}); use more workers, "
        "a smaller model or batch, or a larger memory_per_device"
    )
