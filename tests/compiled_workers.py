"""Worker side of ``test_compiled_layers``: the parity mlp with its layers compiled."""

from __future__ import annotations

import torch

import paratrain
from paratrain.models import loss_for
from tests import workers


def compiled_mlp(how: str, backend: str) -> torch.nn.Sequential:
    """``workers.parity_model("mlp")`` with each layer compiled the two ways users do:
    wrapped (``torch.compile(layer)``, an ``OptimizedModule``) or in place
    (``layer.compile()``, names unchanged)."""
    model = workers.parity_model("mlp")
    if how == "wrapped":
        return torch.nn.Sequential(*(torch.compile(layer, backend=backend) for layer in model))
    for layer in model:
        layer.compile(backend=backend)
    return model


def unwrapped(state: dict) -> dict:
    """A wrapped layer's names carry ``_orig_mod.``; the reference's do not."""
    return {name.replace("_orig_mod.", ""): value for name, value in state.items()}


def compiled_pipeline_worker(runs: list[tuple[str, str, str]], backend: str) -> list[dict]:
    """Each (compile style, schedule, optimizer) trained 10 steps at 2 stages of 4
    micro-batches; the final states."""
    states = []
    for how, schedule, optimizer in runs:
        engine = paratrain.setup(
            compiled_mlp(how, backend),
            optimizer=workers.parity_optimizer(optimizer),
            loss_fn=loss_for("mlp"),
            strategy="pipeline",
            stages=2,
            micro_batches=4,
            schedule=schedule,
        )
        for x, y in workers.parity_batches("mlp"):
            engine.train_step(x, y)
        states.append(unwrapped(engine.state_dict()))
    return states
