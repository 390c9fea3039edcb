"""The Engine contract's pure parts: batch splitting, bucket plans, option checking."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paratrain
from paratrain.parallel.batching import (
    BatchSplitError,
    batch_size,
    check_divisible,
    split_micro,
    take_share,
)
from paratrain.parallel.grad_buckets import plan_buckets


def adam(params):
    return torch.optim.Adam(params, lr=1e-3)


def test_check_divisible_returns_micro_batch_size():
    assert check_divisible(32, replicas=4, micro_batches=2) == 4
    assert check_divisible(8, replicas=1, micro_batches=1) == 8


@pytest.mark.parametrize(
    ("batch", "replicas", "micro", "suggestion"),
    [(10, 4, 2, "e.g. 8 or 16"), (5, 4, 2, "e.g. 8."), (7, 2, 1, "e.g. 6 or 8")],
)
def test_uneven_batch_is_refused_with_sizes_and_a_fix(batch, replicas, micro, suggestion):
    with pytest.raises(BatchSplitError) as caught:
        check_divisible(batch, replicas=replicas, micro_batches=micro)
    message = str(caught.value)
    assert f"global batch of {batch} samples" in message
    assert f"{replicas} replica(s) x {micro} micro-batch(es)" in message
    assert suggestion in message


def test_shares_and_micro_batches_tile_the_batch_in_order():
    batch = (torch.arange(12).reshape(12, 1), {"mask": torch.arange(12) * 10})
    shares = [take_share(batch, i, 3) for i in range(3)]
    assert torch.equal(torch.cat([s[0] for s in shares]), batch[0])
    assert torch.equal(torch.cat([s[1]["mask"] for s in shares]), batch[1]["mask"])
    micro = split_micro(shares[1], 2)
    assert [m[0].flatten().tolist() for m in micro] == [[4, 5], [6, 7]]


def test_batch_size_checks_agreement():
    with pytest.raises(BatchSplitError, match="disagree"):
        batch_size((torch.zeros(4, 2), torch.zeros(3)))
    with pytest.raises(BatchSplitError, match="no tensors"):
        batch_size([])


def test_plan_buckets_exact():
    sizes = [4, 4, 4, 10, 30, 2, 2]
    assert plan_buckets(sizes, bucket_bytes=12, first_bucket_bytes=8) == [
        [0, 1],
        [2],
        [3],
        [4],
        [5, 6],
    ]
    assert plan_buckets(sizes, bucket_bytes=100, first_bucket_bytes=100) == [list(range(7))]
    assert plan_buckets([], bucket_bytes=1, first_bucket_bytes=1) == []


def test_setup_refuses_unknown_strategy_and_option():
    model = nn.Linear(2, 2)
    with pytest.raises(
        ValueError,
        match="unknown strategy .dpp.; choose one of: dp, pipeline, ps, single, tp, zero1, "
        "zero2, zero3",
    ):
        paratrain.setup(model, optimizer=adam, loss_fn=F.mse_loss, strategy="dpp")
    with pytest.raises(ValueError, match="does not take option\\(s\\) bucket_mb"):
        paratrain.setup(model, optimizer=adam, loss_fn=F.mse_loss, strategy="single", bucket_mb=1)


def test_setup_refuses_an_optimizer_instance():
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="factory"):
        paratrain.setup(
            model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            loss_fn=F.mse_loss,
            strategy="single",
        )


def test_dp_outside_a_launched_job_says_what_to_do():
    with pytest.raises(RuntimeError, match="paratrain.launch"):
        paratrain.setup(nn.Linear(2, 2), optimizer=adam, loss_fn=F.mse_loss, strategy="dp")


def test_single_engine_eval_changes_nothing_and_train_refuses_uneven_accumulation():
    torch.manual_seed(0)
    engine = paratrain.setup(
        nn.Linear(3, 1),
        optimizer=adam,
        loss_fn=F.mse_loss,
        strategy="single",
        gradient_accumulation=2,
    )
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    before = engine.state_dict()
    loss = engine.eval_step(x, y)
    # The same forward and loss on the same parameters: exact in principle; approx's
    # default rel 1e-6 (16 fp32 unit roundoffs) allows nothing beyond rounding.
    assert loss == pytest.approx(F.mse_loss(engine.model(x), y).item())
    assert all(torch.equal(before[k], v) for k, v in engine.state_dict().items())
    with pytest.raises(BatchSplitError, match="use a multiple of 2"):
        engine.train_step(torch.randn(5, 3), torch.randn(5, 1))
    stats = engine.train_step(x, y)
    assert stats.step == 1 and stats.samples == 8
    assert stats.loss == pytest.approx(loss)  # the same forward again (two halves): 1e-6
