"""The ``paratrain train`` command line that trains exactly a given configuration.

Why every field and not a chosen few: ``paratrain plan`` ends with the line to paste,
and a line that dropped a model option (``--n-embd 1024``), the memory budget or the data
folder trained another run than the one planned, with no word. So the line names the
model, the data and the strategy, then every field whose value is not its default (the
parser starts from the defaults, so the rest are implied), in the form the parser reads
back to the same value: a switch as ``--flag``/``--no-flag``, None as ``none``, a float
by its shortest exact text, anything with spaces quoted for the shell.
"""

from __future__ import annotations

import shlex
from dataclasses import fields
from typing import Any

from paratrain.config import TrainConfig

_ALWAYS = ("model", "dataset", "strategy")
"""Named even at their defaults: what a reader looks for first."""


def train_line(config: TrainConfig) -> str:
    """``paratrain train ...`` whose parsed configuration equals ``config``."""
    defaults = TrainConfig()
    parts = ["paratrain", "train"]
    for name in _ALWAYS:
        parts.append(_flag(name, getattr(config, name)))
    for item in fields(TrainConfig):
        value = getattr(config, item.name)
        if item.name in _ALWAYS or value == getattr(defaults, item.name):
            continue
        parts.append(_flag(item.name, value))
    return " ".join(parts)


def _flag(name: str, value: Any) -> str:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else "--no-" + name.replace("_", "-")
    if value is None:
        return f"{flag} none"
    return f"{flag} {shlex.quote(str(value))}"
