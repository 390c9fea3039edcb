"""The strategy name -> description registry, and the options all strategies declare.

Kept apart from the Engine contract so that the modules the contract itself uses (the
memory tracker's out-of-memory advice) can ask every strategy for its arithmetic without
importing the contract back. A strategy's description (``description.Strategy``) joins
with ``@register("name")``, which names its engine class too; importing
``paratrain.parallel`` imports every strategy package, so all are registered by then.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from paratrain.parallel.options import StrategyOption, same_declaration

_REGISTRY: dict[str, Any] = {}


def register(name: str) -> Callable[[type], type]:
    """Class decorator adding a strategy description to the registry under ``name``; its
    engine class learns the name and its description (one engine class per strategy)."""

    def add(cls: type) -> type:
        if vars(cls.engine).get("strategy") not in (None, cls):
            raise TypeError(f"{cls.engine.__name__} already runs {cls.engine.name!r}.")
        cls.name = cls.engine.name = name
        cls.engine.strategy = cls
        _REGISTRY[name] = cls
        return cls

    return add


def strategy_names() -> list[str]:
    """The names ``setup(strategy=...)`` accepts."""
    return sorted(_REGISTRY)


def default_strategy() -> str:
    """The strategy a run takes when it names none: the one whose class says ``default``."""
    return next(name for name in strategy_names() if _REGISTRY[name].default)


def strategy_class(name: str) -> Any:
    """The strategy described as ``name`` (its ``engine`` runs it); an unknown name is
    refused with the list."""
    if name not in _REGISTRY:
        names = ", ".join(strategy_names())
        raise ValueError(f"unknown strategy {name!r}; choose one of: {names}.")
    return _REGISTRY[name]


def declared_options() -> dict[str, tuple[StrategyOption, list[str]]]:
    """Every strategy-specific option, once, with the strategies that take it.

    Strategies sharing an option must declare it alike; a clash is a programming error
    caught the first time the options are listed (at import of the configuration).
    """
    merged: dict[str, tuple[StrategyOption, list[str]]] = {}
    for name in strategy_names():
        for option in _REGISTRY[name].options:
            if option.name in merged:
                first, users = merged[option.name]
                if not same_declaration(first, option):
                    raise TypeError(
                        f"strategies {users[0]!r} and {name!r} declare option {option.name!r} "
                        "differently; one option must mean one thing."
                    )
                users.append(name)
            else:
                merged[option.name] = (option, [name])
    return merged
