"""Clipping runs for tests/test_clipping.py; spawned workers import these by name."""

from __future__ import annotations

from tests import tie_workers, workers

MAX_NORM = 0.2  # below every step's gradient norm on the parity models (0.27 to 3), so it clips


def train(strategy: str, kind: str, optimizer: str, **options) -> tuple[dict, list[float]]:
    engine = workers.parity_engine(strategy, kind, optimizer, max_grad_norm=MAX_NORM, **options)
    norms = [engine.train_step(x, y).grad_norm for x, y in workers.parity_batches(kind)]
    return engine.state_dict(), norms


def train_tied(strategy: str, kind: str, optimizer: str, **options) -> tuple[dict, list[float]]:
    """A model of ``tests/tie_workers.py`` (the head shares the embedding's Parameter),
    clipped: under the pipeline the two copies sit on different stages."""
    engine = tie_workers.tied_engine(strategy, kind, optimizer, max_grad_norm=MAX_NORM, **options)
    norms = [engine.train_step(x, y).grad_norm for x, y in workers.parity_batches("gpt")]
    return engine.state_dict(), norms


def train_all(runs: list[tuple]) -> list[tuple]:
    """Each (strategy, kind, optimizer, options); a kind ``tied-...`` names a tied model."""
    return [
        train_tied(strategy, kind.removeprefix("tied-"), opt, **options)
        if kind.startswith("tied-")
        else train(strategy, kind, opt, **options)
        for strategy, kind, opt, options in runs
    ]
