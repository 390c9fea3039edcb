"""One device: the reference every other synchronous engine must equal.

Deliberately the plain PyTorch loop (forward, loss, backward, step), with gradient
accumulation splitting the global batch into equal micro-batches whose losses are scaled
by 1/k so that the accumulated gradient is the gradient of the global-batch mean. Mixed
precision, recompute and the memory ledger hook in exactly as in the dp engine, so that
each is compared with the same reference.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paratrain.parallel import replica_cost
from paratrain.parallel.batching import batch_size, check_divisible, split_micro, to_device
from paratrain.parallel.clipping import clip_local
from paratrain.parallel.cost_model import with_recompute
from paratrain.parallel.description import Strategy
from paratrain.parallel.inputs import call_model
from paratrain.parallel.layout import Layout
from paratrain.parallel.loss_reduction import LossTotals, loss_value
from paratrain.parallel.model_loss_items import part_inputs, with_num_items
from paratrain.parallel.options import RunSpec
from paratrain.parallel.precision import Precision
from paratrain.parallel.recompute import RECOMPUTE, recomputing_forward
from paratrain.parallel.registry import register
from paratrain.parallel.strategy import (
    Engine,
    LossFn,
    OptimizerFactory,
    StepStats,
    optimizer_from_factory,
)


def canonical_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's own state dict as detached CPU copies (safe to keep after more steps)."""
    return {key: value.detach().to("cpu", copy=True) for key, value in model.state_dict().items()}


class SingleDeviceEngine(Engine):
    """Train on this worker's device alone, ignoring any process group.

    Options: ``recompute`` (keep only each layer's input for backward; see ``recompute``).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        layout: Layout,
        optimizer: OptimizerFactory,
        loss_fn: LossFn,
        gradient_accumulation: int = 1,
        precision: str | Precision = "fp32",
        memory_per_device: str | int | None = None,
        max_grad_norm: float | None = None,
        recompute: bool = False,
    ) -> None:
        super().__init__(
            model,
            layout=layout,
            optimizer=optimizer,
            loss_fn=loss_fn,
            gradient_accumulation=gradient_accumulation,
            precision=precision,
            memory_per_device=memory_per_device,
            max_grad_norm=max_grad_norm,
        )
        self.model = model.to(self._device)
        self.recompute = recompute
        self._forward = recomputing_forward(self.model) if recompute else self.model
        self.optimizer = optimizer_from_factory(optimizer, self.model.named_parameters())
        self.memory.watch(self.model.parameters(), model_state=self.model_state_bytes)

    def train_step(self, inputs: Any, targets: Any) -> StepStats:
        samples = batch_size(inputs)
        k = self.gradient_accumulation
        check_divisible(samples, replicas=1, micro_batches=k)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        self.memory.begin_step(self.steps_taken)
        totals = LossTotals(self.loss_fn, targets, targets, parts=k, device=self._device)
        items = with_num_items(self.model, inputs, k, self.loss_fn)
        for index, (micro_in, micro_tgt) in enumerate(
            zip(
                split_micro(to_device(inputs, self._device), k),
                split_micro(to_device(targets, self._device), k),
                strict=True,
            )
        ):
            with self.memory.forward(index), self.precision.autocast(self._device):
                outputs = call_model(self._forward, part_inputs(micro_in, items, k))
                loss = totals.add(self.loss_fn(outputs, micro_tgt))
                del outputs  # not held through backward (a gpt's logits: as big as a block)
            scaled = loss / totals.divisor  # a mean by k, a sum by the global count
            (scaled * self.precision.scale if self.precision.scales_loss else scaled).backward()
            self.memory.release(index)
        grads = (p.grad for p in self.model.parameters())  # read only under fp16
        norm = None  # read after the optimizer's work is queued (see clip_local)
        if self.precision.unscale_and_check(grads, synchronized=True):
            if self.max_grad_norm is not None:
                norm = clip_local(self.model.parameters(), self.max_grad_norm)
            self.optimizer.step()
        if norm is not None:
            self._grad_norm = float(norm)
        self.steps_taken += 1
        self.memory.end_step()
        return self._step_stats(float(totals.contribution()), samples)

    @torch.no_grad()
    def eval_step(self, inputs: Any, targets: Any) -> float:
        was_training = self.model.training
        self.model.eval()
        with self.precision.autocast(self._device):
            result = self.loss_fn(
                call_model(self.model, to_device(inputs, self._device)),
                to_device(targets, self._device),
            )
        self.model.train(was_training)
        return loss_value(result)

    def combine_tally(self, sums: torch.Tensor) -> torch.Tensor:
        """One worker saw the whole batch, whatever job it runs in."""
        return sums

    def state_dict(self) -> dict[str, torch.Tensor]:
        return canonical_state(self.model)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state)


@register("single")
class SingleDeviceStrategy(Strategy):
    """One device: the reference every other strategy must equal (``recompute`` only)."""

    engine = SingleDeviceEngine
    options = (RECOMPUTE,)

    @classmethod
    def layout(cls, devices: int, options: dict[str, Any]) -> Layout:
        """One worker, whatever the job around it (``check_run`` refuses more devices)."""
        return Layout()

    @classmethod
    def check_run(cls, run: RunSpec) -> None:
        if run.devices != 1:
            raise ValueError(
                f"strategy 'single' trains on one device, but devices={run.devices}; "
                "pass --devices 1 or choose --strategy dp."
            )
        super().check_run(run)

    @classmethod
    def plan_layouts(cls, devices: int, *, layer_list: bool) -> list[dict[str, Any]]:
        return with_recompute([{}], layer_list) if devices == 1 else []

    @classmethod
    def predict(cls, costs_for, machine, run, options):
        return replica_cost.predict(costs_for(1), machine, run, options, replicas=1)
