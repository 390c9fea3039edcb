"""Clipping runs under ps for tests/test_ps_clipping.py; spawned workers import these by name."""

from __future__ import annotations

import torch

import paratrain
from paratrain.models import loss_for
from tests import clip_workers, workers

ASYNC_LR = 0.05  # plain SGD (no momentum): the final state is the start minus lr x the sum


def synchronous(cases: list[tuple[str, str, dict]]) -> list[tuple[dict, list[float]]]:
    """Each (kind, optimizer, ps options) clipped at ``clip_workers.MAX_NORM``: the final
    state and the reported norms."""
    results = []
    for kind, optimizer, options in cases:
        engine = workers.parity_engine(
            "ps", kind, optimizer, max_grad_norm=clip_workers.MAX_NORM, staleness=0, **options
        )
        norms = [engine.train_step(x, y).grad_norm for x, y in workers.parity_batches(kind)]
        results.append((engine.state_dict(), norms))
        engine.close()
    return results


def asynchronous(options: dict) -> dict:
    """Plain SGD under asynchrony, clipped: per step the parameters this worker computed
    on (its pull, still in its model after the push) and the norm it reported; then,
    once every worker finished, the servers' final state."""
    engine = paratrain.setup(
        workers.parity_model("mlp"),
        optimizer=lambda params: torch.optim.SGD(params, lr=ASYNC_LR),
        loss_fn=loss_for("mlp"),
        strategy="ps",
        max_grad_norm=clip_workers.MAX_NORM,
        staleness_lr="constant",
        **options,
    )
    steps = []
    for x, y in workers.parity_batches("mlp"):
        norm = engine.train_step(x, y).grad_norm
        pulled = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
        steps.append((pulled, norm))
    engine.finish(wait=True)  # every worker's pushes are in before reading
    result = {"steps": steps, "final": engine.state_dict()}
    engine.close()
    return result
