"""sync_batchnorm=True: replicas' BatchNorm equals full-batch BatchNorm on one device.

Tolerance: the synchronised layer computes the global batch's mean and variance from
float64 sums and normalises in float64, where one device's kernel accumulates in float64
and normalises in fp32; the two differ by fp32 rounding (about 1e-7 relative) in each
output, and the all-reduced gradients by the order of their fp32 sums. Ten steps of
SGD-momentum or Adam grow that to at most about 1e-6 (measured: 5e-7 and below at 2 and
4 workers), inside the suite's parity bar ``TOLERANCE`` (1e-5). Per-replica statistics
(without the option) miss the single-device state by 0.6 to 1.4 and its evaluation loss
by 1e-2 to 7e-2, far above it.
The running variance is the unbiased one with the global count, so it is part of the
comparison, and ``num_batches_tracked`` must match exactly.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import paratrain
from paratrain.parallel.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm
from tests import norm_workers
from tests.test_buffer_broadcast import state_error
from tests.test_parity_dp import TOLERANCE

ENGINES = ["dp", "zero1", "zero2", "zero3"]
OPTIMIZERS = ["sgd", "adam"]


@pytest.fixture(scope="module")
def references() -> dict[str, dict]:
    """The single-device engine on the global batch (plain nn.BatchNorm layers)."""
    return {name: norm_workers.bn_run("single", name, {}) for name in OPTIMIZERS}


@pytest.mark.slow
@pytest.mark.parametrize("devices", [2, 4])
def test_replicas_train_as_one_device_on_the_global_batch(devices, references):
    cases = [
        (strategy, optimizer, {"sync_batchnorm": True})
        for strategy in ENGINES
        for optimizer in OPTIMIZERS
    ]
    if devices == 2:  # without the option, for contrast: per-replica statistics
        cases.append(("dp", "sgd", {"sync_batchnorm": False}))
    ranks = paratrain.launch(norm_workers.bn_runs, devices=devices, args=(cases,))
    for rank, runs in enumerate(ranks):
        for (strategy, optimizer, options), run in zip(cases, runs, strict=True):
            reference = references[optimizer]
            error = state_error(run["state"], reference["state"])
            where = f"{strategy}/{optimizer} at {devices} workers, rank {rank}"
            if not options["sync_batchnorm"]:
                assert error > 100 * TOLERANCE, where
                continue
            assert error <= TOLERANCE, f"{where}: relative error {error:.2e}"
            assert run["losses"] == pytest.approx(reference["losses"], rel=TOLERANCE), where
            assert run["eval"] == pytest.approx(reference["eval"], rel=TOLERANCE), where
    # canonical names: the state loads into the plain model, strictly
    norm_workers.bn_model().load_state_dict(ranks[0][0]["state"])


# ---- the layer in one process: it must equal nn.BatchNorm exactly where one replica ----


LAYERS = [
    (nn.BatchNorm1d, (8, 5), {}),
    (nn.BatchNorm1d, (8, 5, 3), {"momentum": None}),
    (nn.BatchNorm2d, (8, 5, 3, 3), {}),
    (nn.BatchNorm2d, (8, 5, 3, 3), {"affine": False}),
    (nn.BatchNorm2d, (8, 5, 3, 3), {"track_running_stats": False}),
    (nn.BatchNorm3d, (4, 5, 2, 2, 2), {}),
]


@pytest.mark.parametrize(("cls", "shape", "options"), LAYERS, ids=lambda v: str(v))
def test_one_replica_equals_torch_batchnorm(cls, shape, options):
    """Forward, input and parameter gradients, running statistics, then evaluation.

    Bound: fp32 rounding of the outputs (2^-24 relative, times the few operations of a
    normalisation), on values of order 1 to 10: 1e-5 absolute.
    """
    torch.manual_seed(0)
    plain = cls(5, **options)
    if plain.affine:
        with torch.no_grad():
            plain.weight.uniform_(0.5, 1.5)
            plain.bias.uniform_(-1.0, 1.0)
    synced = convert_sync_batchnorm(copy.deepcopy(plain), group=None)
    assert isinstance(synced, SyncBatchNorm)
    for _ in range(3):
        x = 3.0 + torch.randn(shape)
        x_plain, x_synced = x.clone().requires_grad_(), x.clone().requires_grad_()
        upstream = torch.randn(shape)
        out_plain, out_synced = plain(x_plain), synced(x_synced)
        (out_plain * upstream).sum().backward()
        (out_synced * upstream).sum().backward()
        # atol 1e-5: outputs and gradients here are O(1) to O(5) (weight <= 1.5, bias <= 1,
        # |x_hat| <= ~4); the plain kernel's fp32 normalisation of inputs centred at 3
        # loses mean^2 / var = 9 in the variance, so each entry is within ~10 x 5 x 2^-24
        # = 3e-6 of the float64 path's, a third of the bound; a wrong (per-replica)
        # statistic is off by O(0.1).
        torch.testing.assert_close(out_synced, out_plain, rtol=0, atol=1e-5)
        torch.testing.assert_close(x_synced.grad, x_plain.grad, rtol=0, atol=1e-5)
    for name, tensor in plain.state_dict().items():
        torch.testing.assert_close(synced.state_dict()[name], tensor, rtol=0, atol=1e-5)
    if plain.affine:
        torch.testing.assert_close(synced.weight.grad, plain.weight.grad, rtol=0, atol=1e-5)
        torch.testing.assert_close(synced.bias.grad, plain.bias.grad, rtol=0, atol=1e-5)
    plain.eval()
    synced.eval()
    x = 3.0 + torch.randn(shape)
    torch.testing.assert_close(synced(x), plain(x), rtol=0, atol=1e-5)


def test_conversion_keeps_names_and_tensors():
    model = norm_workers.bn_model()
    before = dict(model.state_dict(keep_vars=True))
    converted = convert_sync_batchnorm(model, group=None)
    after = dict(converted.state_dict(keep_vars=True))
    assert list(after) == list(before)
    assert all(after[name] is tensor for name, tensor in before.items())
    assert [type(m) for m in converted if isinstance(m, nn.modules.batchnorm._BatchNorm)] == [
        SyncBatchNorm,
        SyncBatchNorm,
    ]


def test_conversion_leaves_other_norms_and_subclasses_alone():
    class MyNorm(nn.BatchNorm1d):
        pass

    model = nn.Sequential(nn.Linear(4, 4), MyNorm(4), nn.LayerNorm(4))
    converted = convert_sync_batchnorm(model, group=None)
    assert type(converted[1]) is MyNorm and type(converted[2]) is nn.LayerNorm


def test_the_input_rank_is_checked_as_the_original_layer_does():
    synced = convert_sync_batchnorm(nn.BatchNorm2d(3), group=None)
    with pytest.raises(ValueError, match="expected 4D input"):
        synced(torch.randn(4, 3))


def test_a_single_value_per_channel_is_refused_in_training():
    synced = convert_sync_batchnorm(nn.BatchNorm1d(3), group=None)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        synced(torch.randn(1, 3))
