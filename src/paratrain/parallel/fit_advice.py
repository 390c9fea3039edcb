"""Which strategy would fit a model into a per-worker memory budget (the ZeRO arithmetic).

With fp32 weights and Adam, training holds per parameter 4 bytes of weight, 4 of gradient
and 8 of optimizer state (two moments): 16 bytes. Strategies differ in how much of that
each of N workers keeps (Rajbhandari et al., "ZeRO", 2020); each strategy states its own
share next to its code (``Strategy.model_state_per_worker``), for example:

    dp        4 + 4 + 8          every replica holds everything
    zero1     4 + 4 + 8/N        optimizer state sharded
    zero2     4 + (4 + 8)/N      gradients too
    zero3     (4 + 4 + 8)/N      parameters too
    pipeline  (4 + 4 + 8)/S      each of S stages holds its layers (if they balance)

Activations are added as measured on the worker that ran out (a replica's share of the
batch is the same under dp and ZeRO; a pipeline stage holds a different mix, so this is
an estimate there). Communication buffers are left out. The advice names the
*least-sharded* strategy that fits (each strategy's ``advice_rank``), because each step of
sharding costs communication.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from paratrain.parallel.registry import strategy_class, strategy_names
from paratrain.runtime.units import format_bytes


def ranked_strategies() -> list[str]:
    """The strategies advice may name, least sharded first."""
    ranked = [name for name in strategy_names() if strategy_class(name).advice_rank is not None]
    return sorted(ranked, key=lambda name: strategy_class(name).advice_rank)


def model_state_per_worker(
    strategy: str,
    parameters: int,
    workers: int,
    *,
    weight: int = 4,
    gradient: int = 4,
    optimizer: int = 8,
    **options: Any,
) -> float | None:
    """Bytes of weights, gradients and optimizer state one worker holds under ``strategy``
    with its ``options`` (the strategy's own arithmetic); None where it does not model it.
    Without options, the strategy's most sharded layout on ``workers``: advice asks
    whether a strategy could fit at all."""
    description = strategy_class(strategy)
    workers = max(1, workers)
    return description.model_state_per_worker(
        parameters,
        workers,
        options or description.most_sharded_options(workers),
        weight=weight,
        gradient=gradient,
        optimizer=optimizer,
    )


def fitting_strategy(
    *,
    parameters: int,
    workers: int,
    budget: int,
    activations: int = 0,
    candidates: Iterable[str] | None = None,
    exclude: Iterable[str] = (),
) -> str | None:
    """The least-sharded candidate (default: every ranked strategy) whose per-worker need
    fits ``budget``, or None."""
    ranked = ranked_strategies()
    allowed = set(ranked if candidates is None else candidates) - set(exclude)
    for strategy in ranked:
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
    candidates: Iterable[str] | None = None,
    current: str | None = None,
) -> str:
    """A clause for an out-of-memory message: what would fit, or that nothing does."""
    ranked = ranked_strategies()
    candidates = ranked if candidates is None else list(candidates)
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
    needs = {name: model_state_per_worker(name, parameters, workers) for name in ranked}
    least_state = min(needs.values())
    most_sharded = [name for name in candidates if needs.get(name) == least_state]
    least = least_state + activations
    return (
        f"no strategy fits ({basis}: even {' or '.join(most_sharded or ['a fully sharded one'])} "
        f"needs about {format_bytes(least)} per worker{included}); use more workers, "
        "a smaller model or batch, or a larger memory_per_device"
    )
