"""ps with staleness=0 equals the single-device engine (and so dp): same seed, same batches."""

from __future__ import annotations

import pytest

import paratrain
from paratrain.parallel.ps.shared_memory import (
    NAME_PREFIX,
    SHARED_DIR,
    resolve_transport,
)
from tests import ps_workers, workers
from tests.test_parity_dp import TOLERANCE, relative_error

CASES = {
    1: [(("mlp", "adam", 1), {"staleness": 0})],
    2: [
        (("mlp", "sgd", 1), {"staleness": 0}),
        (("gpt", "adam", 2), {"servers": 2}),
        # The default transport is shared memory on this host; gloo carries whole tensors.
        (("mlp", "adam", 1), {"staleness": 0, "transport": "gloo"}),
    ],
    4: [(("gpt", "sgd", 1), {"staleness": 0, "servers": 3})],
}


@pytest.mark.slow
@pytest.mark.parametrize("devices", sorted(CASES))
def test_synchronous_ps_matches_single_device(devices):
    cases = CASES[devices]
    results = paratrain.launch(ps_workers.ps_parity_worker, devices=devices, args=(cases,))
    for index, (case, options) in enumerate(cases):
        reference, reference_losses = workers.train_with("single", *case)
        for rank, rank_results in enumerate(results):
            state, _, transport = rank_results[index]
            assert transport == options.get("transport", resolve_transport("auto"))
            error = relative_error(state, reference)
            assert error <= TOLERANCE, f"{case} {options} worker {rank}: relative error {error:.2e}"
        # Each worker reports the global batch's loss (see the test below), so does their mean.
        per_step = [sum(r[index][1][step] for r in results) / devices for step in range(10)]
        assert per_step == pytest.approx(reference_losses, rel=TOLERANCE), case
    if SHARED_DIR.is_dir():
        left = [p.name for p in SHARED_DIR.iterdir() if p.name.startswith(NAME_PREFIX)]
        assert not left, f"shared-memory files left behind: {left}"
    initial = workers.parity_model(cases[0][0][0]).state_dict()
    assert relative_error(results[0][0][0], initial) > 1e-2, "the parameters never changed"


LOSS_CASES = {
    2: [(("mlp", "adam", 1), {"staleness": 0}), (("gpt", "sgd", 2), {"staleness": 0})],
    4: [
        (("mlp", "sgd", 1), {"staleness": 0, "servers": 2}),
        (("mlp", "adam", 1), {"staleness": 0, "transport": "gloo"}),
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("devices", sorted(LOSS_CASES))
def test_synchronous_ps_reports_the_global_batch_loss_on_every_worker(devices):
    """``StepStats.loss`` is the global batch's mean loss, as the single engine's, on each
    worker (it was the worker's own share's: 0.19 off on a small model). Tolerance 1e-5
    relative, the suite's loss bar: the mean of the shares' means equals the batch's mean
    up to fp32 rounding of the sums (about 1e-7)."""
    cases = LOSS_CASES[devices]
    results = paratrain.launch(ps_workers.ps_parity_worker, devices=devices, args=(cases,))
    for index, (case, options) in enumerate(cases):
        reference, reference_losses = workers.train_with("single", *case)
        for rank, rank_results in enumerate(results):
            state, losses, _ = rank_results[index]
            assert losses == pytest.approx(reference_losses, rel=TOLERANCE), (case, options, rank)
            assert relative_error(state, reference) <= TOLERANCE, (case, options, rank)


@pytest.mark.slow
def test_synchronous_ps_with_parameters_unused_at_some_steps():
    """Unused parameters travel as "no gradient", so the servers' optimizers skip them as
    the plain loop does; the servers build torch's fused SGD, which needed the fallback
    for a parameter's late first gradient (``fused_optim``)."""
    cases = [(("branchy", "sgd", 1), {"staleness": 0}), (("late", "sgd", 1), {"staleness": 0})]
    results = paratrain.launch(ps_workers.ps_parity_worker, devices=2, args=(cases,))
    for index, (case, _options) in enumerate(cases):
        reference, reference_losses = workers.train_with("single", *case)
        for rank_results in results:
            state, losses, _ = rank_results[index]
            assert relative_error(state, reference) <= TOLERANCE, case
            assert losses == pytest.approx(reference_losses, rel=TOLERANCE), case
