"""The shared data-parallel step: its outline calls the plugged-in reducer in order.

One process, one replica, no collectives: the reducer below records each hook and runs
backward itself, so the test sees the outline alone. The gradient check is exact (==):
the step multiplies each of the 2 micro-batches' mean loss by 1/2 where the plain loop
below divides by 2 (both exact for a power of two), accumulating in the same order.
"""

from __future__ import annotations

import torch
from torch import nn

from paratrain.parallel.data_parallel_step import DataParallelStep
from paratrain.parallel.loss_reduction import LossTotals
from paratrain.parallel.memory_tracking import MemoryTracker
from paratrain.parallel.precision import Precision


class _RecordingReducer:
    def __init__(self, model: nn.Module, *, finite: bool = True) -> None:
        self.model, self.finite, self.calls = model, finite, []

    def zero_grad(self) -> None:
        self.calls.append("zero_grad")
        self.model.zero_grad(set_to_none=True)

    def begin_micro_batch(self, *, last: bool) -> None:
        self.calls.append(f"begin(last={last})")

    def before_backward(self, scaled: torch.Tensor, totals: LossTotals, *, last: bool) -> None:
        self.calls.append(f"before_backward(last={last})")

    def backward(self, scaled: torch.Tensor) -> None:
        self.calls.append("backward")
        scaled.backward()

    def after_backward(self) -> None:
        self.calls.append("after_backward")

    def finish(self, totals: LossTotals) -> float:
        self.calls.append("finish")
        return float(totals.contribution())

    def grads_finite(self, precision: Precision, device: torch.device) -> bool:
        self.calls.append("vote")
        return self.finite

    def clip(self, max_norm: float) -> float:
        self.calls.append("clip")
        return 1.5

    def after_optimizer_step(self) -> None:
        self.calls.append("after_step")


def _step(model, reducer, optimizer, *, max_grad_norm=None) -> DataParallelStep:
    memory = MemoryTracker(
        strategy="test",
        device=torch.device("cpu"),
        memory_per_device=None,
        total_parameters=sum(p.numel() for p in model.parameters()),
        candidates=lambda: [],
    )
    return DataParallelStep(
        model=model,
        forward=model,
        reducer=reducer,
        optimizer=optimizer,
        precision=Precision.of("fp32"),
        memory=memory,
        device=torch.device("cpu"),
        replicas=1,
        gradient_accumulation=2,
        max_grad_norm=max_grad_norm,
        share=lambda batch: batch,
        sync_buffers=lambda *, training: None,
    )


def _data():
    torch.manual_seed(0)
    return nn.Linear(3, 2), torch.randn(4, 3), torch.randn(4, 2)


def test_the_outline_calls_the_reducer_in_order_and_steps_on_the_mean_gradient():
    model, inputs, targets = _data()
    reference = nn.Linear(3, 2)
    reference.load_state_dict(model.state_dict())
    for half in (slice(0, 2), slice(2, 4)):
        (nn.functional.mse_loss(reference(inputs[half]), targets[half]) / 2).backward()
    reducer = _RecordingReducer(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    done = _step(model, reducer, optimizer, max_grad_norm=1.0).run(
        inputs, targets, loss_fn=nn.functional.mse_loss, step=0
    )
    micro = ["before_backward", "backward", "after_backward"]
    assert reducer.calls == [
        "zero_grad",
        "begin(last=False)",
        *[c if c != "before_backward" else "before_backward(last=False)" for c in micro],
        "begin(last=True)",
        *[c if c != "before_backward" else "before_backward(last=True)" for c in micro],
        "finish",
        "vote",
        "clip",
        "after_step",
    ]
    assert done.grad_norm == 1.5 and done.samples == 4
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours.grad, theirs.grad)


def test_a_vote_against_skips_clip_step_and_after_step():
    model, inputs, targets = _data()
    before = [p.detach().clone() for p in model.parameters()]
    reducer = _RecordingReducer(model, finite=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    done = _step(model, reducer, optimizer, max_grad_norm=1.0).run(
        inputs, targets, loss_fn=nn.functional.mse_loss, step=0
    )
    assert reducer.calls[-2:] == ["finish", "vote"] and done.grad_norm is None
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
