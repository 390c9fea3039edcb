"""Every pipeline schedule with split layers: 2 stages x tensor 2 on gpt (4 workers), each
equal to one device. ZB-H1 and ZB-H2 split the backward into B and W under a tensor
group's collectives (and, under recompute, re-run each layer's forward all-reduces in B
and in W); interleaved 1F1B splits each chunk's planned layers.

Tolerance: ``TOLERANCE`` (1e-5 relative after 10 steps), the fp32 parity bar derived in
tests/test_parity_dp.py; ``test_tensor_compose`` explains why a tensor group's partial sums
stay inside it. A defect (a W that skips a colwise input's all-reduce, a chunk sending to
the wrong tensor rank) moves the weights by 1e-2 or more.
"""

from __future__ import annotations

import pytest

import paratrain
from tests import tensor_workers
from tests.test_parity_dp import TOLERANCE, relative_error

LAYOUT = {"stages": 2, "tensor": 2}
CASES = [
    ("gpt", "adam", 1, {**LAYOUT, "schedule": "1f1b", "micro_batches": 4}),
    ("gpt", "sgd", 1, {**LAYOUT, "schedule": "gpipe", "micro_batches": 2}),
    ("gpt", "adam", 1, {**LAYOUT, "schedule": "1f1b", "virtual_stages": 2, "micro_batches": 4}),
    ("gpt", "sgd", 1, {**LAYOUT, "schedule": "zb-h1", "micro_batches": 4}),
    ("gpt", "adam", 1, {**LAYOUT, "schedule": "zb-h2", "micro_batches": 4}),
    ("gpt", "sgd", 1, {**LAYOUT, "schedule": "zb-h2", "micro_batches": 4, "recompute": True}),
]


@pytest.mark.slow
def test_every_schedule_with_split_layers_equals_one_device():
    references = [tensor_workers.train("single", case)[:2] for case in CASES]
    results = paratrain.launch(tensor_workers.parity_worker, devices=4, args=("pipeline", CASES))[0]
    for case, (state, losses, calls, held), (reference, reference_losses) in zip(
        CASES, results, references, strict=True
    ):
        error = relative_error(state, reference)
        assert error <= TOLERANCE, f"{case}: relative error {error:.2e}"
        assert losses == pytest.approx(reference_losses, rel=TOLERANCE), case
        whole = sum(p.numel() for p in tensor_workers.build("gpt").parameters())
        assert held < whole, f"{case}: rank 0 holds all {whole} parameters: nothing split"
        assert calls["forward"] > 0 and calls["backward"] > 0, f"{case}: {calls}"
