"""A step reads no tensor on the host before its optimizer has stepped.

On a GPU a host read (``float(loss)``, ``.item()``) waits for the device to finish all it
was given; read before ``optimizer.step()``, the device then idles while the optimizer's
launches run on the host. That cost paratrain's dp 3.4-4.0% of a step against the plain
loop on an H100 (benchmarks/bench_gpu.py --part overhead; 1.0-1.8% once the loss and the
clipped norm were read after the step). The CPU shows no such cost, so the order itself is
checked here: every host read of the step's second call (the first builds lazily) is
recorded by a dispatch mode, beside the optimizer's step.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import paratrain
from paratrain.models import build_model, loss_for


class _HostReads(TorchDispatchMode):
    """Records each read of a tensor's value on the host, in order."""

    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.log.append("host read")
        return func(*args, **(kwargs or {}))


def _order_of_one_step(strategy: str, max_grad_norm: float | None) -> tuple[list[str], float]:
    """The host reads and the optimizer's step of one step, in order (the class's step is
    wrapped, as an engine may build its own optimizer from the one it is handed)."""
    log: list[str] = []
    torch.manual_seed(0)
    model = build_model("mlp", in_features=8, hidden=8, depth=2, classes=3)
    engine = paratrain.setup(
        model,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        loss_fn=loss_for("mlp"),
        strategy=strategy,
        max_grad_norm=max_grad_norm,
    )
    inputs, targets = torch.randn(4, 8), torch.randint(0, 3, (4,))
    engine.train_step(inputs, targets)
    step = torch.optim.SGD.step

    def logged_step(self, *args, **kwargs):
        log.append("optimizer.step")
        return step(self, *args, **kwargs)

    torch.optim.SGD.step = logged_step
    try:
        with _HostReads(log):
            stats = engine.train_step(inputs, targets)
    finally:
        torch.optim.SGD.step = step
    return log, stats.loss


def order_worker(strategy: str, max_grad_norm: float | None) -> tuple[list[str], float]:
    return _order_of_one_step(strategy, max_grad_norm)


@pytest.mark.parametrize("max_grad_norm", [None, 0.01])
def test_single_reads_the_loss_and_norm_after_the_optimizer_step(max_grad_norm):
    log, loss = _order_of_one_step("single", max_grad_norm)
    assert "optimizer.step" in log and loss == loss
    assert "host read" not in log[: log.index("optimizer.step")], log


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("max_grad_norm", [None, 0.01])
def test_dp_reads_the_loss_and_norm_after_the_optimizer_step(devices, max_grad_norm):
    """With replicas, one read stays before the step: the summed count of parameters no
    replica used, which every replica must agree on before it drops their gradients (as
    DDP's ``find_unused_parameters`` reads its own); nothing else."""
    expected = 0 if devices == 1 else 1
    results = paratrain.launch(order_worker, devices=devices, args=("dp", max_grad_norm))
    for log, loss in results:
        assert "optimizer.step" in log and loss == loss
        assert log[: log.index("optimizer.step")].count("host read") == expected, log
