"""recompute=True under zero1-3: the same parameters as without it (and as single), fewer
activations in the ledger, and for zero3 the same collectives (each unit gathered once
per backward even though backward reruns its forward)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import paratrain
from paratrain.models import loss_for
from tests import workers, zero_workers
from tests.test_parity_dp import TOLERANCE, relative_error

# (strategy, model, gradient_accumulation, torch.utils.checkpoint early stop)
CASES = [
    ("zero1", "gpt", 1, True),
    ("zero2", "gpt", 1, True),
    ("zero3", "gpt", 1, True),
    # Without early stop a recompute runs the whole segment, post-forward hook included:
    # the hook must not free the unit backward is about to use.
    ("zero3", "gpt", 2, False),
    # mlp segments are (Linear, ReLU): ReLU's backward starts the recompute before the
    # gradient reaches the Linear, so the recompute's pre-hook is the backward gather.
    ("zero3", "mlp", 1, True),
]


def single_run(kind: str, accumulation: int) -> tuple[dict, list[float]]:
    engine = workers.parity_engine("single", kind, "adam", accumulation)
    batches = workers.parity_batches(kind)[: zero_workers.RECOMPUTE_STEPS]
    losses = [engine.train_step(x, y).loss for x, y in batches]
    return engine.state_dict(), losses


@pytest.mark.slow
def test_zero_recompute_matches_and_holds_fewer_activations():
    references = {(kind, k): single_run(kind, k) for _, kind, k, _ in CASES}
    ranks = paratrain.launch(zero_workers.recompute_worker, devices=2, args=(CASES,))
    for results in ranks:
        for strategy, kind, k, early_stop in CASES:
            key = f"{strategy}/{kind}/k{k}/{early_stop}"
            on, off = results[f"{key}/True"], results[f"{key}/False"]
            state, losses = references[(kind, k)]
            for run in (on, off):
                error = relative_error(run["state"], state)
                assert error <= TOLERANCE, f"{key}: relative error {error:.2e} against single"
                assert run["losses"] == pytest.approx(losses, rel=TOLERANCE), key
            assert relative_error(on["state"], off["state"]) <= TOLERANCE, key
            assert on["comm_bytes"] == off["comm_bytes"], f"{key}: recompute changed the messages"
            if strategy == "zero3":
                assert not any(on["gathered_after"]), f"{key}: a unit stayed gathered"
            peak_on, peak_off = on["activation_peak"], off["activation_peak"]
            if kind == "gpt":  # blocks save much more than their input
                assert 0 < peak_on < 0.5 * peak_off, (key, peak_on, peak_off)
            else:  # the mlp saves little beyond each linear's input: never more
                assert 0 < peak_on <= peak_off, (key, peak_on, peak_off)


def test_zero3_recompute_refuses_a_model_that_is_not_a_layer_list():
    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers(x)

    with pytest.raises(ValueError, match="zero3 with recompute=True needs the model itself"):
        paratrain.setup(
            Wrapped(),
            optimizer=workers.parity_optimizer("adam"),
            loss_fn=loss_for("mlp"),
            strategy="zero3",
            recompute=True,
        )


@pytest.mark.parametrize("strategy", zero_workers.STAGES)
def test_zero_recompute_refuses_batchnorm_before_starting_workers(strategy):
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    with pytest.raises(ValueError, match="running statistics of BatchNorm layer '1' twice"):
        paratrain.setup(
            model,
            optimizer=workers.parity_optimizer("adam"),
            loss_fn=loss_for("mlp"),
            strategy=strategy,
            recompute=True,
        )


@pytest.mark.parametrize("strategy", zero_workers.STAGES)
def test_trainer_passes_recompute_to_the_zero_engines(strategy):
    from paratrain.config import TrainConfig
    from paratrain.run.build import strategy_options

    config = TrainConfig(model="gpt", strategy=strategy, recompute=True)
    assert strategy_options(config, bundle=None)["recompute"] is True  # bundle: pipeline only
