"""Tensor parallelism (Megatron-LM's): layers split over the workers, each sees the batch.

Every worker holds its slice of each split layer (``plan``, ``apply``) and the whole of
everything else (LayerNorms, embeddings not split, rowwise biases), and runs forward and
backward on the whole global batch: the split layers' ``f``/``g`` operators (``mappings``)
make every replicated activation, and so every replicated gradient, whole and equal on
every worker, so no gradient all-reduce is needed and none is double counted. A
colwise/rowwise pair costs one all-reduce of its output forward and one of its input's
gradient backward.

The mesh: for now the tensor group is the whole job (``tensor`` equal to the worker
count); data x tensor, and compositions with zero and the pipeline, are refused until
they are built. When they are, tensor is the innermost dimension (a tensor group on
neighbouring ranks, as on one node's NVLink).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paratrain.parallel.batching import batch_size, check_divisible, split_micro, to_device
from paratrain.parallel.clipping import clip_coefficient, squared_norm
from paratrain.parallel.inputs import call_model
from paratrain.parallel.loss_reduction import LossTotals, loss_value
from paratrain.parallel.options import RunSpec
from paratrain.parallel.precision import Precision
from paratrain.parallel.registry import register
from paratrain.parallel.strategy import (
    Engine,
    LossFn,
    OptimizerFactory,
    StepStats,
    optimizer_from_factory,
    require_process_group,
)
from paratrain.parallel.tp import mappings
from paratrain.parallel.tp.apply import apply_plan
from paratrain.parallel.tp.checkpoint import TensorCheckpointState
from paratrain.parallel.tp.options import TENSOR
from paratrain.parallel.tp.plan import resolve_plan
from paratrain.parallel.tp.rng import share_stream
from paratrain.runtime import comm


def check_mesh(devices: int, tensor: int | None) -> int:
    """The tensor degree (all devices when None); anything but all of them is refused."""
    tensor = devices if tensor is None else tensor
    if tensor != devices:
        raise ValueError(
            f"tensor={tensor} over {devices} workers (data x tensor) is not yet available; "
            f"pass tensor={devices} (every worker), or run on {tensor} workers."
        )
    return tensor


@register("tp")
class TensorParallelEngine(TensorCheckpointState, Engine):
    """Split layers over every worker; each worker runs the whole batch.

    Options: ``tensor`` (workers each split layer is spread over; every worker by
    default, the only degree available yet), ``tp_plan`` (``setup`` only: fnmatch
    patterns over module names -> "colwise", "rowwise", "vocab" or "replicate"; without
    it the plan is found, see ``plan``).
    """

    options = (TENSOR,)

    @classmethod
    def replicas(cls, devices: int, options: dict[str, Any]) -> int:
        return devices // check_mesh(devices, options.get("tensor"))

    @classmethod
    def check_run(cls, run: RunSpec) -> None:
        """The mesh and batch, then the plan on a meta-device copy of the model."""
        tensor = check_mesh(run.devices, run.options.get("tensor"))
        super().check_run(run)
        if run.build_model is not None:
            resolve_plan(run.build_model(), tensor, run.options.get("tp_plan"))

    @classmethod
    def parameter_share(cls, workers: int, options: dict[str, Any]) -> float:
        """Split layers hold 1/tensor each, replicated ones all: 1/tensor is a lower bound."""
        return 1.0 / (options.get("tensor") or workers)

    @classmethod
    def model_state_per_worker(
        cls, parameters, workers, options, *, weight=4, gradient=4, optimizer=8
    ) -> float:
        """Everything per parameter, at the lower-bound share (every layer split)."""
        return (weight + gradient + optimizer) * cls.parameter_share(workers, options) * parameters

    @classmethod
    def summary_lines(cls, metrics: dict[str, Any]) -> list[str]:
        return [
            f"  mesh              {metrics['tensor']} tensor ({metrics['plan']})",
            f"  parameters/worker {metrics['parameters_per_worker']:,} of "
            f"{metrics['parameters']:,} (split layers 1/{metrics['tensor']} each)",
        ]

    def __init__(
        self,
        model: nn.Module,
        *,
        optimizer: OptimizerFactory,
        loss_fn: LossFn,
        gradient_accumulation: int = 1,
        precision: str | Precision = "fp32",
        memory_per_device: str | int | None = None,
        max_grad_norm: float | None = None,
        tensor: int | None = None,
        tp_plan: dict[str, str] | None = None,
    ) -> None:
        super().__init__(
            model,
            optimizer=optimizer,
            loss_fn=loss_fn,
            gradient_accumulation=gradient_accumulation,
            precision=precision,
            memory_per_device=memory_per_device,
            max_grad_norm=max_grad_norm,
        )
        require_process_group(self.name)
        self.tensor = check_mesh(comm.world_size(), tensor)
        self.group = None  # the whole job, while tensor is every worker
        self.tensor_rank = comm.rank(self.group)
        self._parameters = sum(p.numel() for p in model.parameters())
        model = model.to(self._device)
        # every slice is cut from rank 0's model, so the slices make one model
        comm.broadcast_tensors([*model.parameters(), *model.buffers()], group=self.group)
        share_stream(self._device, group=self.group)  # replicated activations' dropout alike
        self.plan = resolve_plan(model, self.tensor, tp_plan)
        self.specs = apply_plan(
            model, self.plan, rank=self.tensor_rank, tensor=self.tensor, group=self.group
        )
        self.model = model
        self.optimizer = optimizer_from_factory(optimizer, self.model.named_parameters())
        self.memory.watch(self.model.parameters(), model_state=self.model_state_bytes)

    @property
    def world_size(self) -> int:
        return self.tensor

    def train_step(self, inputs: Any, targets: Any) -> StepStats:
        samples = batch_size(inputs)
        k = self.gradient_accumulation
        check_divisible(samples, replicas=1, micro_batches=k)
        bytes_before = comm.bytes_sent()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        self.memory.begin_step(self.steps_taken)
        inputs, targets = to_device(inputs, self._device), to_device(targets, self._device)
        totals = LossTotals(self.loss_fn, targets, targets, parts=k, device=self._device)
        micro = zip(split_micro(inputs, k), split_micro(targets, k), strict=True)
        for index, (micro_in, micro_tgt) in enumerate(micro):
            with self.memory.forward(index), self.precision.autocast(self._device):
                loss = totals.add(self.loss_fn(call_model(self.model, micro_in), micro_tgt))
            scaled = loss / totals.divisor  # a mean by k, a sum by the global count
            (scaled * self.precision.scale if self.precision.scales_loss else scaled).backward()
            self.memory.release(index)
        grads = (p.grad for p in self.model.parameters())
        # split gradients differ between workers: the overflow vote is a message (fp16)
        if self.precision.unscale_and_check(grads, group=self.group):
            if self.max_grad_norm is not None:
                self._grad_norm = self._clip(self.max_grad_norm)
            self.optimizer.step()
        self.steps_taken += 1
        self.memory.end_step()
        sent = comm.bytes_sent() - bytes_before
        return self._step_stats(float(totals.contribution()), samples, sent)

    def _clip(self, max_norm: float) -> float:
        """The whole model's gradient norm: a split parameter's slices add their squares
        over the tensor group, a replicated one (whole, equal everywhere) counts once."""
        split, whole = [], []
        for name, param in self.model.named_parameters():
            if param.grad is not None:
                (split if name in self.specs else whole).append(param.grad)
        squares = squared_norm(split, device=self._device).reshape(1)
        comm.all_reduce_sum(squares, group=self.group)
        total = torch.sqrt(squares[0] + squared_norm(whole, device=self._device)).float()
        grads = split + whole
        if grads:
            torch._foreach_mul_(grads, clip_coefficient(total, max_norm).to(grads[0].device))
        return float(total)

    def load_checkpoint(self, path):
        """As every engine's, then the tensor group's stream made one again (``rng``)."""
        checkpoint = super().load_checkpoint(path)
        share_stream(self._device, group=self.group)
        return checkpoint

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
        """Every worker saw the whole batch: its own sums are the batch's."""
        return sums

    def run_metrics(self) -> dict[str, Any]:
        return {
            "tensor": self.tensor,
            "parameters": self._parameters,
            "parameters_per_worker": sum(p.numel() for p in self.model.parameters()),
            "plan": self.plan.describe(),
            "tensor_all_reduces": dict(mappings.CALLS),
        }

    def layout(self) -> dict[str, Any]:
        return {**super().layout(), "tensor": self.tensor}
