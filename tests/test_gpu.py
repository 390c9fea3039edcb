"""GPU tier: dp on NCCL equals the single-device engine (skipped where there is no GPU)."""

from __future__ import annotations

import pytest
import torch

import paratrain
from tests import workers
from tests.test_parity_dp import TOLERANCE, relative_error

pytestmark = pytest.mark.gpu


def test_dp_on_nccl_matches_single_device():
    devices = min(2, torch.cuda.device_count())
    cases = [("mlp", "adam", 2), ("gpt", "sgd", 1)]
    results = paratrain.launch(workers.gpu_dp_parity_worker, devices=devices, args=(cases,))
    for case, (state, _) in zip(cases, results[0], strict=True):
        reference, _ = workers.train_with("single", *case)
        assert relative_error(state, reference) <= TOLERANCE, case
