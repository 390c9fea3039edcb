"""The ps strategy's options, as the command line, run files and ``setup`` take them."""

from __future__ import annotations

from typing import Any

from paratrain.parallel.options import StrategyOption
from paratrain.parallel.ps.shared_memory import TRANSPORTS
from paratrain.parallel.ps.stale_lr import POLICIES


def parse_straggler(text: str | dict[str, Any]) -> dict[str, Any]:
    """``"1:3"`` (command line, run file) as the engine's ``{"rank": 1, "slowdown": 3.0}``."""
    if isinstance(text, dict):
        return text
    rank, _, slowdown = str(text).partition(":")
    try:
        setting = {"rank": int(rank), "slowdown": float(slowdown)}
    except ValueError:
        setting = None
    if setting is None or setting["rank"] < 0 or setting["slowdown"] < 1:
        raise ValueError(
            f"straggler must be RANK:SLOWDOWN with a slowdown of at least 1, such as 1:3, "
            f"not {text!r}."
        )
    return setting


OPTIONS = (
    StrategyOption("servers", int, 1, "parameter-server processes", minimum=1),
    StrategyOption(
        "staleness",
        int,
        0,
        "steps a worker may run ahead of the slowest (0 = synchronous, none = asynchronous)",
        minimum=0,
        none_allowed=True,
    ),
    StrategyOption(
        "staleness_lr",
        str,
        "inverse",
        "inverse divides a push's learning rate by its staleness + 1, constant applies "
        "every push at --lr",
        choices=POLICIES,
    ),
    StrategyOption(
        "backup_workers",
        int,
        0,
        "with --staleness 0: a version needs only the first N - this many workers' pushes; "
        "later ones fold into the next (no waiting for stragglers)",
        minimum=0,
    ),
    StrategyOption(
        "lookahead",
        bool,
        True,
        "asynchronous or bounded: a step's pull returns the parameters extrapolated to "
        "where they will be when its push lands",
    ),
    StrategyOption(
        "transport",
        str,
        "auto",
        "how pushes and pulls travel: auto (shared memory where the host has /dev/shm, "
        "else gloo), shared_memory or gloo",
        choices=TRANSPORTS,
    ),
    StrategyOption(
        "straggler",
        str,
        None,
        "RANK:SLOWDOWN, e.g. 1:3 makes worker 1 three times slower",
        parse=parse_straggler,
    ),
)
