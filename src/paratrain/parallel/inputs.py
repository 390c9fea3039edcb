"""How a batch reaches the model's forward, the same way under every strategy.

A dict batch is passed as keyword arguments (``model(**inputs)``: Hugging Face models take
``input_ids=..., attention_mask=..., labels=...``), a tuple as positional arguments
(``model(*inputs)`` for ``forward(x, z)``), anything else, a tensor or a list, as the one
argument. What the model returns (a tensor, a tuple, a dict or a ``ModelOutput``) reaches
``loss_fn(outputs, targets)`` unchanged. Every engine splits every tensor of a dict or
tuple along its first (batch) dimension; other values (flags, ``None``) go to every share
as they are. ``targets`` may be ``None`` where the model computes its own loss
(``loss_fn=lambda outputs, _: outputs.loss``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def as_arguments(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``inputs`` as the positional and keyword arguments of the forward call."""
    if isinstance(inputs, dict):
        return (), inputs
    if isinstance(inputs, tuple):
        return inputs, {}
    return (inputs,), {}


def call_model(forward: Callable[..., Any], inputs: Any) -> Any:
    """``forward`` called on ``inputs`` by the convention above."""
    args, kwargs = as_arguments(inputs)
    return forward(*args, **kwargs)
