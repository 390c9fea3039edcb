"""Argument checks shared by the model builders.

Builders run before any worker starts, so a bad size should fail there with one sentence
that names the knob, not later as a shape error deep inside a forward pass on some rank.
"""

from __future__ import annotations


def require_int(*, minimum: int = 1, **values: int) -> None:
    """Raise ValueError unless every keyword value is an int (not a bool) >= ``minimum``."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")
