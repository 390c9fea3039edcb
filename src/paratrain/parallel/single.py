"""One device: the reference every other synchronous engine must equal.

Deliberately the plain PyTorch loop (forward, loss, backward, step), with gradient
accumulation splitting the global batch into equal micro-batches whose losses are scaled
by 1/k so that the accumulated gradient is the gradient of the global-batch mean.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paratrain.parallel.batching import batch_size, check_divisible, split_micro, to_device
from paratrain.parallel.strategy import Engine, LossFn, OptimizerFactory, StepStats, register


def canonical_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's own state dict as detached CPU copies (safe to keep after more steps)."""
    return {key: value.detach().to("cpu", copy=True) for key, value in model.state_dict().items()}


@register("single")
class SingleDeviceEngine(Engine):
    """Train on this worker's device alone, ignoring any process group."""

    def __init__(
        self,
        model: nn.Module,
        *,
        optimizer: OptimizerFactory,
        loss_fn: LossFn,
        gradient_accumulation: int = 1,
    ) -> None:
        super().__init__(
            model, optimizer=optimizer, loss_fn=loss_fn, gradient_accumulation=gradient_accumulation
        )
        self.model = model.to(self._device)
        self.optimizer = optimizer(self.model.parameters())

    def train_step(self, inputs: Any, targets: Any) -> StepStats:
        samples = batch_size(inputs)
        k = self.gradient_accumulation
        check_divisible(samples, replicas=1, micro_batches=k)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self._device)
        for micro_in, micro_tgt in zip(
            split_micro(to_device(inputs, self._device), k),
            split_micro(to_device(targets, self._device), k),
            strict=True,
        ):
            loss = self.loss_fn(self.model(micro_in), micro_tgt)
            (loss / k).backward()
            total += loss.detach()
        self.optimizer.step()
        self.steps_taken += 1
        return StepStats(loss=float(total / k), step=self.steps_taken, samples=samples)

    @torch.no_grad()
    def eval_step(self, inputs: Any, targets: Any) -> float:
        was_training = self.model.training
        self.model.eval()
        loss = self.loss_fn(
            self.model(to_device(inputs, self._device)), to_device(targets, self._device)
        )
        self.model.train(was_training)
        return float(loss)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return canonical_state(self.model)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state)
