"""Tensor parallelism (Megatron-LM's): layers split over the workers, each sees the batch.

Every worker holds its slice of each split layer (``plan``, ``apply``) and the whole of
everything else (LayerNorms, embeddings not split, rowwise biases), and runs forward and
backward on the whole global batch: the split layers' ``f``/``g`` operators (``mappings``)
make every replicated activation, and so every replicated gradient, whole and equal on
every worker, so no gradient all-reduce is needed and none is double counted. A
colwise/rowwise pair costs one all-reduce of its output forward and one of its input's
gradient backward.

The mesh (``mesh``): ``tensor`` workers split each layer (all of them by default); where
``tensor`` is smaller, the workers form ``replicas x tensor`` with tensor innermost, each
replica takes its share of the global batch as in dp, and every parameter's gradient (a
slice or a whole one) is averaged over its data group by dp's bucketed all-reduce, which
also carries the loss. Compositions with zero and the pipeline are not built yet.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paratrain.parallel.batching import batch_size, check_divisible, split_micro
from paratrain.parallel.buffer_sync import buffer_broadcast
from paratrain.parallel.clipping import clip_coefficient, squared_norm
from paratrain.parallel.grad_buckets import BucketedGradientReducer, MiB
from paratrain.parallel.inputs import call_model
from paratrain.parallel.loss_reduction import LossTotals
from paratrain.parallel.options import RunSpec
from paratrain.parallel.precision import Precision
from paratrain.parallel.registry import register
from paratrain.parallel.replica_rng import separate_streams
from paratrain.parallel.replicas import ReplicaShare
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
from paratrain.parallel.tp.mesh import check_mesh, tensor_mesh
from paratrain.parallel.tp.options import TENSOR
from paratrain.parallel.tp.plan import resolve_plan
from paratrain.parallel.tp.rng import share_stream
from paratrain.runtime import comm


@register("tp")
class TensorParallelEngine(TensorCheckpointState, ReplicaShare, Engine):
    """Split layers over each tensor group; each group runs its replica's share.

    Options: ``tensor`` (workers each split layer is spread over; every worker by
    default; fewer makes ``workers / tensor`` replicas), ``bucket_mb`` (the replicas'
    gradient all-reduce buckets, as dp's), ``tp_plan`` (``setup`` only: fnmatch
    patterns over module names -> "colwise", "rowwise", "vocab" or "replicate"; without
    it the plan is found, see ``plan``).
    """

    options = (TENSOR,)  # bucket_mb: a keyword of setup only, for now

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
            f"  mesh              {metrics['mesh']} ({metrics['plan']})",
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
        bucket_mb: float = 25.0,
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
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be positive, not {bucket_mb}.")
        self.mesh = tensor_mesh(tensor)
        self.tensor, self.tensor_rank = self.mesh.tensor, self.mesh.tensor_rank
        self.tensor_group = self.mesh.tensor_group
        # ReplicaShare's names: the replicas split the batch over the data group
        self.group, self._replicas = self.mesh.data_group, self.mesh.replicas
        self._replica_rank = self.mesh.replica
        self._parameters = sum(p.numel() for p in model.parameters())
        model = model.to(self._device)
        # every slice is cut from rank 0's model, so the slices make one model
        comm.broadcast_tensors([*model.parameters(), *model.buffers()])
        separate_streams()  # each worker its own stream, then each tensor group one
        share_stream(self._device, group=self.tensor_group)
        self.plan = resolve_plan(model, self.tensor, tp_plan)
        self.specs = apply_plan(
            model, self.plan, rank=self.tensor_rank, tensor=self.tensor, group=self.tensor_group
        )
        self.model = model
        self.buffer_sync = buffer_broadcast(model, group=self.group, enabled=self._replicas > 1)
        self.reducer: BucketedGradientReducer | None = None
        if self._replicas > 1:
            bucket = int(bucket_mb * MiB)
            self.reducer = BucketedGradientReducer(
                list(model.parameters()),
                group=self.group,
                bucket_bytes=bucket,
                first_bucket_bytes=bucket,
            )
        self.optimizer = optimizer_from_factory(optimizer, self.model.named_parameters())
        self.memory.watch(
            self.model.parameters(),
            model_state=self.model_state_bytes,
            communication=self._loss_slot_bytes,
        )

    def _loss_slot_bytes(self) -> int:
        """Bytes of the slot the loss rides in, in the replicas' last bucket (as dp's)."""
        if self.reducer is None:
            return 0
        return sum(b.extra_slots * b.buffer.element_size() for b in self.reducer.buckets)

    def model_state_bytes(self) -> dict[str, int]:
        """As ``Engine``'s, with the loss slot left to communication buffers."""
        state = super().model_state_bytes()
        if state["gradients"]:
            state["gradients"] -= self._loss_slot_bytes()
        return state

    @property
    def world_size(self) -> int:
        return self.tensor * self._replicas

    def train_step(self, inputs: Any, targets: Any) -> StepStats:
        samples = batch_size(inputs)
        replicas, k = self._replicas, self.gradient_accumulation
        check_divisible(samples, replicas=replicas, micro_batches=k)
        bytes_before = comm.bytes_sent()
        share_in, share_tgt = self._share(inputs), self._share(targets)
        self.model.train()
        if self.reducer is not None:
            self.reducer.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        self.memory.begin_step(self.steps_taken)
        totals = LossTotals(
            self.loss_fn, targets, share_tgt, parts=k * replicas, device=self._device
        )
        backward_scale = self.precision.loss_factor(1.0 / (k * replicas))
        self._sync_buffers(training=True)
        micro = zip(split_micro(share_in, k), split_micro(share_tgt, k), strict=True)
        for index, (micro_in, micro_tgt) in enumerate(micro):
            with self.memory.forward(index), self.precision.autocast(self._device):
                loss = totals.add(self.loss_fn(call_model(self.model, micro_in), micro_tgt))
            if self.reducer is not None and index == k - 1:
                self.reducer.arm(extras=totals.contribution())  # rides in the last bucket
            totals.scaled(loss, backward_scale, self.precision.loss_factor()).backward()
            self.memory.release(index)
        if self.reducer is not None:
            mean_loss = float(self.reducer.finish(extras_count=1)[0])
        else:
            mean_loss = float(totals.contribution())
        grads = (p.grad for p in self.model.parameters())
        # split gradients differ between workers: the overflow vote is a message (fp16)
        if self.precision.unscale_and_check(grads):
            if self.max_grad_norm is not None:
                self._grad_norm = self._clip(self.max_grad_norm)
            self.optimizer.step()
        self.steps_taken += 1
        self.memory.end_step()
        return self._step_stats(mean_loss, samples, comm.bytes_sent() - bytes_before)

    def _clip(self, max_norm: float) -> float:
        """The whole model's gradient norm: a split parameter's slices add their squares
        over the tensor group, a replicated one (whole, equal everywhere) counts once."""
        split, whole = [], []
        for name, param in self.model.named_parameters():
            if param.grad is not None:
                (split if name in self.specs else whole).append(param.grad)
        squares = squared_norm(split, device=self._device).reshape(1)
        comm.all_reduce_sum(squares, group=self.tensor_group)
        total = torch.sqrt(squares[0] + squared_norm(whole, device=self._device)).float()
        grads = split + whole
        if grads:
            torch._foreach_mul_(grads, clip_coefficient(total, max_norm).to(grads[0].device))
        return float(total)

    def load_checkpoint(self, path):
        """As every engine's, then the tensor group's stream made one again (``rng``)."""
        checkpoint = super().load_checkpoint(path)
        share_stream(self._device, group=self.tensor_group)
        return checkpoint

    def run_metrics(self) -> dict[str, Any]:
        return {
            "tensor": self.tensor,
            "mesh": self.mesh.describe(),
            "parameters": self._parameters,
            "parameters_per_worker": sum(p.numel() for p in self.model.parameters()),
            "plan": self.plan.describe(),
            "tensor_all_reduces": dict(mappings.CALLS),
        }

    def writes_shard(self) -> bool:
        return comm.rank() == 0

    def layout(self) -> dict[str, Any]:
        return {**super().layout(), "tensor": self.tensor, "replicas": self._replicas}
