"""How a batch reaches forward, under every engine: a tuple as arguments, a dict as
keywords (plain values given to every share, ``targets`` may be None where the model
computes its loss), a model's dict output reaching loss_fn unchanged, and a pipeline
carrying a dict and a tuple of tensors between its stages."""

from __future__ import annotations

import pytest
import torch

import paratrain
from paratrain.parallel.inputs import as_arguments, call_model
from tests import input_workers
from tests.test_parity_dp import TOLERANCE, relative_error


def plain_loop(kind: str) -> tuple[dict, list[float]]:
    """The loop a user writes, calling the model as the convention says."""
    model = input_workers.build(kind)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = input_workers.loss_for(kind)
    losses = []
    for x, y in input_workers.batches(kind):
        optimizer.zero_grad()
        outputs = (
            model(*x) if isinstance(x, tuple) else model(**x) if isinstance(x, dict) else model(x)
        )
        loss = loss_fn(outputs, y)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def test_the_call_convention():
    seen = []
    record = lambda *args, **kwargs: seen.append((args, kwargs))  # noqa: E731
    call_model(record, {"a": 1})
    call_model(record, (1, 2))
    call_model(record, [1, 2])
    assert seen == [((), {"a": 1}), ((1, 2), {}), (([1, 2],), {})]
    assert as_arguments(torch.ones(1))[1] == {}


@pytest.mark.parametrize("kind", ["two_inputs", "keywords"])
def test_single_takes_tuples_and_dicts(kind):
    reference, reference_losses = plain_loop(kind)
    state, losses = input_workers.train("single", kind)
    assert relative_error(state, reference) <= TOLERANCE
    # Exact in principle: the single engine runs the plain loop's ops in its order; 1e-6
    # (16 fp32 unit roundoffs) allows nothing beyond rounding.
    assert losses[:-1] == pytest.approx(reference_losses, rel=1e-6)


@pytest.mark.slow
def test_every_replica_engine_takes_tuples_and_dicts():
    """dp, zero1-3 and synchronous ps at 2 workers equal the plain loop (fp32, no dropout:
    the same bound as every parity test)."""
    runs = [
        (strategy, kind, {"staleness": 0} if strategy == "ps" else {})
        for strategy in ("dp", "zero1", "zero2", "zero3", "ps")
        for kind in ("two_inputs", "keywords")
    ]
    results = paratrain.launch(input_workers.train_all, devices=2, args=(runs,))
    references = {kind: plain_loop(kind) for kind in ("two_inputs", "keywords")}
    for (strategy, kind, _), (state, losses) in zip(runs, results[0], strict=True):
        reference, _ = references[kind]
        error = relative_error(state, reference)
        assert error <= TOLERANCE, (strategy, kind, error)
        assert all(torch.isfinite(torch.tensor(losses))), (strategy, kind)


@pytest.mark.slow
def test_pipeline_carries_a_dict_and_a_tuple_between_stages():
    """Stage boundaries after a layer returning a dict (a float tensor, an int tensor and a
    string) and after one returning a tuple; 3 stages, with and without recompute, and
    under the zero-bubble schedules (whose W the stages fed by another take from the
    units' outputs, proved on a graph entered through a dict and a tuple)."""
    reference, reference_losses = plain_loop("structured")
    runs = [
        ("pipeline", "structured", {"stages": 3, "micro_batches": 2}),
        ("pipeline", "structured", {"stages": 3, "micro_batches": 4, "recompute": True}),
        ("pipeline", "structured", {"stages": 3, "micro_batches": 4, "schedule": "zb-h1"}),
        ("pipeline", "structured", {"stages": 3, "micro_batches": 4, "schedule": "zb-h2"}),
    ]
    results = paratrain.launch(input_workers.train_all, devices=3, args=(runs,))
    for state, losses in results[0]:
        assert relative_error(state, reference) <= TOLERANCE
        assert losses[:-1] == pytest.approx(reference_losses, rel=TOLERANCE)
