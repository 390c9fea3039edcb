"""Frozen parameters (``requires_grad=False``, as a user fine-tuning part of a model sets
them) train as in the plain loop under every synchronous strategy: left exactly as they
were, and the trained ones as one device trains them.

The plain loop leaves a frozen parameter's ``.grad`` None and the optimizer skips it, so
momentum, Adam's moments and AdamW's decoupled weight decay never touch it; an engine
that reduced, sharded or split it like a trained one, or handed it a zero gradient,
would move it under AdamW (weight decay alone moves it 0.1% a step) or shift the trained
ones' buckets and shards. The model (``workers.frozen_layers``) freezes the first weight
(on the pipeline's first stage, fed data, whose zero-bubble W is one whole backward), a
whole Linear between trained ones and the head's bias beside its trained weight.

Tolerance: the suite's (``TOLERANCE``, 1e-5 relative per parameter): the engines compute
the same updates and differ from one device in the order of fp32 sums, about 1e-7
relative a step over these 10 steps. Frozen tensors are compared bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import paratrain
from paratrain.models import loss_for
from tests import workers
from tests.schedule_memory_workers import SCHEDULES
from tests.test_parity_dp import TOLERANCE, relative_error

FROZEN = ("0.weight", "4.weight", "4.bias", "6.bias")
OPTIMIZERS = ("sgd", "adamw")
PIPELINE = {"strategy": "pipeline", "stages": 2, "micro_batches": 4}


def plain_loop(optimizer: str) -> dict:
    model, batches = workers.parity_model("frozen"), workers.parity_batches("frozen")
    return workers.plain_loop_state(model, optimizer, batches, loss_for("mlp"))


def test_the_model_freezes_what_the_tests_name():
    """Guards the tests below: the named tensors are the frozen ones, and the plain loop
    leaves them as built while it trains the rest."""
    model = workers.parity_model("frozen")
    assert {n for n, p in model.named_parameters() if not p.requires_grad} == set(FROZEN)
    trained = plain_loop("adamw")
    built = model.state_dict()
    for name, value in trained.items():
        assert torch.equal(value, built[name]) == (name in FROZEN), name


def check(options: list[dict], results: list[tuple[dict, list]], devices: int) -> None:
    built = workers.parity_model("frozen").state_dict()
    plain = {name: plain_loop(name) for name in OPTIMIZERS}
    runs = [(option, name) for option in options for name in OPTIMIZERS]
    for (option, name), (state, _) in zip(runs, results, strict=True):
        label = f"{option} {name} at {devices} workers"
        error = relative_error(state, plain[name])
        assert error <= TOLERANCE, f"{label}: relative error {error:.2e}"
        for frozen in FROZEN:
            assert torch.equal(state[frozen], built[frozen]), f"{label}: {frozen} moved"


def trained_at(options: list[dict], devices: int) -> list[tuple[dict, list]]:
    runs = [(option, name) for option in options for name in OPTIMIZERS]
    cases = [("frozen", name, 1) for _, name in runs]
    args = (cases, [option for option, _ in runs])
    return paratrain.launch(workers.strategies_worker, devices=devices, args=args)[0]


@pytest.mark.slow
def test_every_strategy_leaves_frozen_parameters_as_the_plain_loop():
    """dp, ZeRO 1-3, tp, and the pipeline under every schedule (and ZB-H1 with recompute)
    at 2 workers; SGD-momentum and AdamW."""
    options = [{"strategy": s} for s in ("dp", "zero1", "zero2", "zero3", "tp")]
    options += [{**PIPELINE, **schedule} for schedule in SCHEDULES.values()]
    options += [{**PIPELINE, "schedule": "zb-h1", "recompute": True}]
    check(options, trained_at(options, 2), 2)


@pytest.mark.slow
def test_replicated_stages_and_four_way_sharding_leave_frozen_parameters():
    """4 workers: zero3 sharded four ways, and 2 replicas of 2 stages under ZB-H2 (the
    replicas' bucketed reduction built from the trained parameters only)."""
    options = [{"strategy": "zero3"}, {**PIPELINE, "schedule": "zb-h2"}]
    check(options, trained_at(options, 4), 4)
