"""BatchNorm running statistics under the replica engines equal torch DDP's (its defaults).

The reference is ``torch.nn.parallel.DistributedDataParallel`` with ``broadcast_buffers=True``
on the same gloo workers: where running statistics are concerned, DDP is defined to differ
from one device, so the single-device engine cannot be the reference here.

Tolerance: the engines and DDP run the same fp32 operations on the same shares; they
differ only in how gradients are averaged (DDP divides each gradient by the world size
inside its bucket; the engines scale the loss by 1/replicas, ZeRO reduce-scatters flat
units), which changes a gradient by a few units of fp32 rounding (2^-24, 6e-8 relative)
per step. Ten steps of SGD-momentum or Adam on this model turn that into at most about
1e-6 (measured: 6e-7 and below), so the suite's parity bar ``TOLERANCE`` (1e-5) holds with
room to spare. Keeping each replica's own statistics (``broadcast_buffers=False``, the old
behaviour) misses DDP's by 7e-2 to 9e-2 on replica 1's state and 1.4e-3 to 1.7e-3 on the
evaluation loss, two to four orders of magnitude above the bar.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import paratrain
from paratrain.config import ConfigError, TrainConfig
from paratrain.parallel import RunSpec, strategy_class
from paratrain.runtime.launch import WorkerError
from tests import norm_workers
from tests.test_parity_dp import TOLERANCE, relative_error

ENGINES = ["dp", "zero1", "zero2", "zero3"]


def state_error(state: dict, reference: dict) -> float:
    """``relative_error`` over the float tensors; integer counters must match exactly."""
    assert state.keys() == reference.keys()
    for name, expected in reference.items():
        if not expected.is_floating_point():
            assert torch.equal(state[name], expected), name
    floats = [name for name, tensor in reference.items() if tensor.is_floating_point()]
    return relative_error({n: state[n] for n in floats}, {n: reference[n] for n in floats})


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_running_statistics_and_eval_loss_equal_ddp(optimizer):
    cases = [(name, {}) for name in ENGINES] + [("dp", {"broadcast_buffers": False})]
    ranks = paratrain.launch(norm_workers.ddp_and_engines, devices=2, args=(optimizer, cases))
    for rank, result in enumerate(ranks):
        ddp = result["ddp"]
        *engines, per_replica = result["engines"]
        for name, run in zip(ENGINES, engines, strict=True):
            error = state_error(run["state"], ddp["state"])
            assert error <= TOLERANCE, f"{name} rank {rank}: relative error {error:.2e}"
            assert run["eval"] == pytest.approx(ddp["eval"], rel=TOLERANCE), name
            assert run["losses"] == pytest.approx(ddp["losses"], rel=TOLERANCE), name
        if rank == 1:  # the test tells the two behaviours apart
            assert state_error(per_replica["state"], ddp["state"]) > 100 * TOLERANCE
            assert per_replica["eval"] != pytest.approx(ddp["eval"], rel=100 * TOLERANCE)


def test_broadcast_buffers_is_an_option_of_the_replica_engines():
    assert TrainConfig().broadcast_buffers is True
    assert TrainConfig(strategy="zero3", broadcast_buffers=False).strategy_options() == {
        "recompute": False,
        "broadcast_buffers": False,
        "sync_batchnorm": False,
        "units": None,
    }
    foreign = "--no-broadcast-buffers is a dp, tp, zero1, zero2, zero3"
    with pytest.raises(ConfigError, match=foreign):
        TrainConfig(strategy="pipeline", broadcast_buffers=False)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_pipeline_replicas_evaluate_and_save_the_first_replica_s_statistics(optimizer):
    """2 stages x 2 replicas: each replica of a stage updates its running statistics from
    its own micro-batches, so, as under DDP's default, the first replica's reach the
    others before each step and evaluation. Then ``eval_step`` is the loss of the model
    the state describes: evaluated in one process from rank 0's ``state_dict()``.

    Tolerance: ``TOLERANCE`` (1e-5). In eval mode BatchNorm uses the same running
    statistics on every replica and every sample's output is the same fp32 function of
    the same values; what differs is the batch the matrix kernels see (a micro-batch of 4
    against 16) and the order the 16 per-sample losses are summed in (micro-batches, then
    replicas): a few units of 2^-24 each, about 16 u = 1e-6 of the loss. Each replica
    keeping its own statistics (the pipeline did) moves the second replica's running
    statistics by 5-11 % and the evaluation loss by 3e-3 (SGD) and 6e-3 (Adam), hundreds
    of times the bar."""
    ranks = paratrain.launch(norm_workers.pipeline_bn_run, devices=4, args=(optimizer,))
    model = norm_workers.bn_model()
    model.load_state_dict(ranks[0]["state"], strict=True)
    model.eval()
    with torch.no_grad():
        x, y = norm_workers.bn_eval_batch()
        expected = float(torch.nn.functional.cross_entropy(model(x), y))
    stages = 2  # rank = replica * stages + stage
    for rank, result in enumerate(ranks):
        assert result["eval"] == pytest.approx(expected, rel=TOLERANCE), rank
        first = ranks[rank % stages]["buffers"]  # the first replica of this rank's stage
        assert result["buffers"].keys() == first.keys() and first, rank
        for name, buffer in result["buffers"].items():
            assert torch.equal(buffer, first[name]), (rank, name)


PS_REFUSAL = r"strategy 'ps' would keep the running statistics of BatchNorm layer '1' apart"


def test_ps_refuses_batchnorm_statistics_before_any_worker_starts():
    """ps servers hold parameters only: each worker's running statistics would drift
    apart (synchronous ps, 2 workers, 10 steps: eval_step 1.7437 on one worker, 1.7406 on
    the other), so the run is refused with the strategies that keep them equal."""
    run = RunSpec(devices=2, global_batch=16, options={"staleness": 0})
    with pytest.raises(ValueError, match=PS_REFUSAL + r".*use strategy 'dp' or 'zero1'"):
        strategy_class("ps").check_run(replace(run, build_model=norm_workers.bn_model))
    ps = strategy_class("ps")
    ps.check_run(replace(run, devices=1, build_model=norm_workers.bn_model))  # one worker
    ps.check_run(replace(run, build_model=lambda: torch.nn.Sequential(torch.nn.LayerNorm(4))))


@pytest.mark.slow
def test_ps_setup_refuses_batchnorm_statistics():
    with pytest.raises(WorkerError, match=PS_REFUSAL):
        paratrain.launch(norm_workers.bn_setup, devices=2, args=("ps", {"staleness": 0}))
