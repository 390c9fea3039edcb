"""Gradient clipping by the global norm under every engine equals
``torch.nn.utils.clip_grad_norm_`` in the plain loop: replicas, ZeRO slices, pipeline
stages (a tied weight counted once). ps: tests/test_ps_clipping.py."""

from __future__ import annotations

import pytest
import torch

import paratrain
from paratrain.config import TrainConfig
from paratrain.models import loss_for
from paratrain.trainer import ConfigError
from tests import clip_workers, workers
from tests.test_parity_dp import TOLERANCE, relative_error


def plain_loop(kind: str, optimizer: str, tie: bool = False) -> tuple[dict, list[float]]:
    model = workers.parity_model(kind)
    opt = workers.parity_optimizer(optimizer)(model.parameters())
    norms = []
    for x, y in workers.parity_batches(kind):
        opt.zero_grad()
        loss_for("gpt" if kind == "gpt" else "mlp")(model(x), y).backward()
        norms.append(
            float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip_workers.MAX_NORM))
        )
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def check(result, reference, label) -> None:
    state, norms = result
    error = relative_error(state, reference[0])
    assert error <= TOLERANCE, (label, error)
    # the norm before clipping, summed in another order: a few float32 roundings apart
    assert norms == pytest.approx(reference[1], rel=TOLERANCE), label


def test_the_runs_clip():
    """Guards the tests below: a bound the gradients never reach would test nothing."""
    for kind in ("mlp", "gpt"):
        _, norms = plain_loop(kind, "sgd")
        assert min(norms) > clip_workers.MAX_NORM, kind


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_single_clips_as_the_plain_loop(kind):
    check(clip_workers.train("single", kind, "sgd"), plain_loop(kind, "sgd"), kind)


@pytest.mark.slow
def test_every_engine_clips_by_the_global_norm():
    runs = [
        (strategy, kind, optimizer, options)
        for kind in ("mlp", "gpt")
        for optimizer in ("sgd", "adam")
        for strategy, options in (
            ("dp", {}),
            ("zero1", {}),
            ("zero2", {}),
            ("zero3", {}),
            ("pipeline", {"stages": 2, "micro_batches": 2}),
        )
    ]
    references = {(k, o): plain_loop(k, o) for k in ("mlp", "gpt") for o in ("sgd", "adam")}
    results = paratrain.launch(clip_workers.train_all, devices=2, args=(runs,))
    for run, result in zip(runs, results[0], strict=True):
        check(result, references[(run[1], run[2])], run)
    hybrid = [("pipeline", "gpt", "sgd", {"stages": 2, "micro_batches": 2})]
    results = paratrain.launch(clip_workers.train_all, devices=4, args=(hybrid,))
    check(results[0][0], references[("gpt", "sgd")], "2 x 2 pipeline")


def test_the_command_line_passes_the_bound_to_the_engine():
    from paratrain.trainer import strategy_options

    config = TrainConfig(model="mlp", strategy="zero2", max_grad_norm=1.5)
    assert strategy_options(config, bundle=None)["max_grad_norm"] == 1.5
    with pytest.raises(ConfigError, match="max_grad_norm must be positive"):
        TrainConfig(max_grad_norm=0.0)
