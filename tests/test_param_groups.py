"""Parameter groups built by name (no weight decay on biases and norms): the factory gets
(name, parameter) pairs under every engine, with canonical names; the ZeRO engines carry
the groups over to their flat slices (tests/test_zero_param_groups.py goes further)."""

from __future__ import annotations

import pytest

import paratrain
from paratrain.models import loss_for
from paratrain.parallel.strategy import wants_names
from tests import group_workers, workers
from tests.test_parity_dp import TOLERANCE, relative_error


def plain_loop() -> dict:
    model = workers.parity_model("gpt")
    optimizer = group_workers.grouped_adamw(list(model.named_parameters()))
    for x, y in workers.parity_batches("gpt"):
        optimizer.zero_grad()
        loss_for("gpt")(model(x), y).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_factory_asks_for_names_by_its_first_parameter():
    assert wants_names(group_workers.grouped_adamw)
    assert not wants_names(lambda params: None)


def test_single_groups_by_name_as_the_plain_loop():
    state, _ = group_workers.train("single")
    assert relative_error(state, plain_loop()) <= TOLERANCE


@pytest.mark.slow
def test_dp_pipeline_ps_and_zero_group_by_name():
    """Canonical names reach the factory on every pipeline stage, and on the ps servers."""
    reference = plain_loop()
    runs = [
        ("dp", {}),
        ("pipeline", {"stages": 2, "micro_batches": 2}),
        ("pipeline", {"stages": 2, "micro_batches": 2, "virtual_stages": 2}),
        ("pipeline", {"stages": 2, "micro_batches": 4, "schedule": "zb-h1"}),
        ("ps", {}),
        ("zero1", {}),
        ("zero3", {}),
    ]
    results = paratrain.launch(group_workers.train_all, devices=2, args=(runs,))
    for (strategy, _), (state, _) in zip(runs, results[0], strict=True):
        error = relative_error(state, reference)
        assert error <= TOLERANCE, (strategy, error)
