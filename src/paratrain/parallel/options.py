"""What a strategy declares about itself: its options, and the run it is asked to fit.

Each engine lists its options as ``StrategyOption`` values next to its code, so the command
line flags, the TOML keys and their help text are generated from the strategies rather than
listed a second time, and a new strategy adds flags by declaring them. A ``RunSpec`` is what
the parent process knows about a run before any worker starts: an engine's ``check_run``
refuses from it what cannot work, with one sentence that says what to change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn


@dataclass(frozen=True)
class StrategyOption:
    """One strategy-specific option: a keyword of ``setup``, a ``--flag`` and a TOML key.

    ``kind`` is the type a value has in a run configuration (``int``, ``float``, ``str`` or
    ``bool``); ``parse`` turns that value into what the engine takes where the two differ
    (``"2,3,3"`` into ``[2, 3, 3]``), raising ``ValueError`` with a sentence otherwise.
    """

    name: str
    kind: type
    default: Any
    help: str
    choices: tuple[Any, ...] | None = None
    minimum: float | None = None
    none_allowed: bool = False
    """Whether the word "none" (TOML has no null) means ``None``, e.g. ps staleness."""
    parse: Callable[[Any], Any] | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def check(self, value: Any) -> None:
        """Refuse a value outside the declared choices or below the declared minimum."""
        if value is None:
            if self.default is not None and not self.none_allowed:
                raise ValueError(f"{self.name} needs a value; its default is {self.default!r}.")
            return
        if self.choices is not None and value not in self.choices:
            names = [str(choice) for choice in self.choices]
            allowed = " or ".join(names) if len(names) < 3 else "one of " + ", ".join(names)
            raise ValueError(f"{self.name} must be {allowed}, not {value!r}.")
        if self.minimum is not None and value < self.minimum:
            minimum = int(self.minimum) if float(self.minimum).is_integer() else self.minimum
            raise ValueError(f"{self.name} must be at least {minimum}, not {value}.")
        self.engine_value(value)

    def engine_value(self, value: Any) -> Any:
        """The value as the engine's keyword takes it."""
        if value is None or self.parse is None:
            return value
        return self.parse(value)


def same_declaration(a: StrategyOption, b: StrategyOption) -> bool:
    """Two strategies may share an option (``bucket_mb``) only if they mean the same by it."""
    return (a.kind, a.default, a.choices, a.minimum, a.none_allowed, a.parse) == (
        b.kind,
        b.default,
        b.choices,
        b.minimum,
        b.none_allowed,
        b.parse,
    )


@dataclass(frozen=True)
class RunSpec:
    """A run as the parent process sees it before any worker starts.

    ``options`` holds the strategy's own options as the engine takes them. ``build_model``
    builds the model on the meta device (shapes, no weights), for checks that need its
    layers; ``sample_inputs(n)`` gives ``n`` training inputs, for engines that measure the
    model before splitting it.
    """

    devices: int
    global_batch: int
    gradient_accumulation: int = 1
    options: dict[str, Any] = field(default_factory=dict)
    external_job: bool = False
    timeout_s: float = 300.0
    max_grad_norm: float | None = None
    build_model: Callable[[], nn.Module] | None = None
    sample_inputs: Callable[[int], Any] | None = None


def given(options: dict[str, Any], option: StrategyOption) -> Any:
    """``option``'s value in a run's ``options``, its declared default where left out: the
    one place a default (a pipeline's stage count) is read, so none is restated."""
    value = options.get(option.name)
    return option.default if value is None else value
