"""pipeline with recompute=True refuses BatchNorm, as dp and zero do.

The recompute reruns a stage's forward in training mode, which updated the running
statistics a second time per micro-batch (measured on ``bn_model``, 10 steps of 4
micro-batches: ``num_batches_tracked`` 80 where it should be 40). The refusal names the
layer and the alternative, before any worker starts (``check_run``) and in ``setup``
before any collective.
"""

from __future__ import annotations

import pytest

import paratrain
from paratrain.parallel import RunSpec, strategy_class
from paratrain.runtime.launch import WorkerError
from tests import norm_workers

MESSAGE = "running statistics of BatchNorm layer '1' twice"


def test_check_run_refuses_batchnorm_with_recompute():
    run = RunSpec(
        devices=2,
        global_batch=16,
        options={"stages": 2, "recompute": True},
        build_model=norm_workers.bn_model,
    )
    with pytest.raises(ValueError, match=MESSAGE + r".*use recompute=False"):
        strategy_class("pipeline").check_run(run)
    strategy_class("pipeline").check_run(  # the same run without recompute is fine
        RunSpec(
            devices=2, global_batch=16, options={"stages": 2}, build_model=norm_workers.bn_model
        )
    )


@pytest.mark.slow
def test_setup_refuses_batchnorm_with_recompute():
    with pytest.raises(WorkerError, match=MESSAGE):
        paratrain.launch(
            norm_workers.bn_setup, devices=2, args=("pipeline", {"stages": 2, "recompute": True})
        )
