"""Pipeline model parallel: contiguous stages of the layer list, fed micro-batches.

Each worker keeps only its stage's layers (the rest are moved to the meta device, which
frees their memory) and builds the optimizer over those parameters alone. A schedule from
``schedules`` (GPipe or 1F1B) tells each stage the order of its forwards and backwards;
activations and their gradients move between neighbours by point-to-point messages
(``p2p``). With more workers than stages, each stage is replicated over a data-parallel
group (``mesh``) whose members average that stage's gradients with the same bucketed
all-reduce the dp engine uses.

Equal to the single-device engine: micro-batch losses are scaled by 1/(micro-batches x
accumulation rounds x replicas), so the summed gradients are those of the global-batch mean.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from paratrain.parallel.batching import batch_size, check_divisible, split_micro, take_share
from paratrain.parallel.data_parallel import require_process_group
from paratrain.parallel.grad_buckets import BucketedGradientReducer, MiB
from paratrain.parallel.layer_profile import param_profiles, profile_layers
from paratrain.parallel.layers import LayerSlice, layer_list
from paratrain.parallel.p2p import StageLink
from paratrain.parallel.partition import (
    check_stages,
    partition,
    stage_bounds,
    validate_balance,
)
from paratrain.parallel.schedules import get_schedule
from paratrain.parallel.strategy import (
    Engine,
    LossFn,
    OptimizerFactory,
    RecordsTimeline,
    StepStats,
    register,
)
from paratrain.runtime import comm
from paratrain.runtime.devices import current_device
from paratrain.runtime.memory import ActivationMeter
from paratrain.runtime.mesh import pipeline_mesh


def choose_balance(
    layers: nn.Sequential,
    stages: int,
    *,
    balance: list[int] | None,
    balance_by: str,
    sample_input: Any = None,
) -> list[int]:
    """The layer count of each stage: given, or balanced by the chosen cost.

    Measured costs differ from worker to worker, so rank 0 decides and broadcasts.
    """
    check_stages(len(layers), stages)
    if balance is not None:
        return validate_balance(balance, layers=len(layers), stages=stages)
    decided: list[Any] = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        if balance_by in ("time", "memory"):
            if sample_input is None:
                raise ValueError(
                    f"balance_by={balance_by!r} measures the layers on a sample: pass "
                    "sample_input=<one micro-batch of inputs>, or use balance_by='params'."
                )
            profiles = profile_layers(list(layers), sample_input)
        else:
            profiles = param_profiles(list(layers))
        decided[0] = partition(balance_by, profiles, stages)
    if dist.is_initialized():
        dist.broadcast_object_list(decided, src=0)
    return list(decided[0])


@register("pipeline")
class PipelineEngine(RecordsTimeline, Engine):
    """Stages of the layer list on consecutive workers, scheduled GPipe or 1F1B.

    Options: ``stages`` (pipeline depth; workers / stages replicas of each stage),
    ``micro_batches`` per replica and step (default 2 x stages), ``schedule`` ("1f1b" or
    "gpipe"), ``balance`` (explicit layers per stage) or ``balance_by`` ("params", "time",
    "memory"; the last two need ``sample_input``), ``recompute`` (keep only each stage's
    input per micro-batch and recompute the rest in backward), ``bucket_mb`` (gradient
    all-reduce buckets across replicas).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        optimizer: OptimizerFactory,
        loss_fn: LossFn,
        gradient_accumulation: int = 1,
        stages: int = 2,
        micro_batches: int | None = None,
        schedule: str = "1f1b",
        balance: list[int] | None = None,
        balance_by: str = "params",
        sample_input: Any = None,
        recompute: bool = False,
        bucket_mb: float = 25.0,
    ) -> None:
        super().__init__(
            model, optimizer=optimizer, loss_fn=loss_fn, gradient_accumulation=gradient_accumulation
        )
        require_process_group(self.name)
        layers, prefix = layer_list(model)
        self.micro_batches = micro_batches or 2 * stages
        if self.micro_batches < 1:
            raise ValueError(f"micro_batches must be at least 1, not {self.micro_batches}.")
        self.schedule_name = schedule
        self.actions = get_schedule(schedule)(stages, self.micro_batches)
        self.mesh = pipeline_mesh(stages)
        self.balance = choose_balance(
            layers, stages, balance=balance, balance_by=balance_by, sample_input=sample_input
        )
        start, end = stage_bounds(self.balance)[self.mesh.stage]
        self.slice = LayerSlice(start, end, prefix)
        self._device = current_device()
        for index, layer in enumerate(layers):
            if not start <= index < end:
                layer.to("meta")  # frees the memory of layers other stages own
        self.module = nn.Sequential(*[layers[i] for i in range(start, end)]).to(self._device)
        self.recompute = recompute
        self.reducer: BucketedGradientReducer | None = None
        if self.mesh.replicas > 1:
            comm.broadcast_tensors(
                [*self.module.parameters(), *self.module.buffers()], src=0, group=self.mesh.dp_group
            )
            self.reducer = BucketedGradientReducer(
                list(self.module.parameters()),
                group=self.mesh.dp_group,
                bucket_bytes=int(bucket_mb * MiB),
                first_bucket_bytes=int(bucket_mb * MiB),
                extra_slots=0,
            )
        # A stage may hold only parameter-free layers (an activation, a reshape).
        trainable = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = optimizer(trainable) if trainable else None
        self.link = StageLink(self._device)
        self.activations = ActivationMeter(exclude=list(self.module.parameters()))
        self.events: list[dict[str, Any]] = []

    # -- Engine interface ---------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def rank(self) -> int:
        return comm.rank()

    @property
    def world_size(self) -> int:
        return self.mesh.stages * self.mesh.replicas

    @property
    def model(self) -> nn.Module:
        """This worker's stage (the only layers it holds)."""
        return self.module

    def timeline_meta(self) -> dict[str, Any]:
        return {
            "stages": self.mesh.stages,
            "micro_batches": self.micro_batches,
            "schedule": self.schedule_name,
            "replicas": self.mesh.replicas,
            "balance": self.balance,
            "recompute": self.recompute,
        }

    def timeline_identity(self) -> dict[str, Any]:
        return {"rank": self.rank, "stage": self.mesh.stage, "replica": self.mesh.replica}

    def activation_peak_bytes(self) -> int:
        return self.activations.peak

    def train_step(self, inputs: Any, targets: Any) -> StepStats:
        samples = batch_size(inputs)
        rounds, micro = self.gradient_accumulation, self.micro_batches
        replicas = self.mesh.replicas
        check_divisible(samples, replicas=replicas, micro_batches=rounds * micro)
        bytes_before = comm.bytes_sent()
        self.module.train()
        if self.reducer is not None:
            self.reducer.zero_grad()
        elif self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        share_in = take_share(inputs, self.mesh.replica, replicas)
        share_tgt = take_share(targets, self.mesh.replica, replicas)
        scale = 1.0 / (rounds * micro * replicas)
        loss_sum = torch.zeros((), device=self._device)
        for index, (round_in, round_tgt) in enumerate(
            zip(split_micro(share_in, rounds), split_micro(share_tgt, rounds), strict=True)
        ):
            loss_sum += self._run_round(round_in, round_tgt, scale, last=index == rounds - 1)
        if self.reducer is not None:
            self.reducer.finish()
        if self.optimizer is not None:
            self.optimizer.step()
        self.steps_taken += 1
        mean_loss = self._share_loss(loss_sum / (rounds * micro))
        return StepStats(
            loss=mean_loss,
            step=self.steps_taken,
            samples=samples,
            comm_bytes=comm.bytes_sent() - bytes_before,
        )

    @torch.no_grad()
    def eval_step(self, inputs: Any, targets: Any) -> float:
        replicas, micro = self.mesh.replicas, self.micro_batches
        check_divisible(batch_size(inputs), replicas=replicas, micro_batches=micro)
        was_training = self.module.training
        self.module.eval()
        share_in = split_micro(take_share(inputs, self.mesh.replica, replicas), micro)
        share_tgt = split_micro(take_share(targets, self.mesh.replica, replicas), micro)
        loss_sum = torch.zeros((), device=self._device)
        for m in range(micro):
            x = self._stage_input(share_in, m, header=m == 0)
            y = self.module(x)
            if self.mesh.is_last:
                loss_sum += self.loss_fn(y, share_tgt[m].to(self._device)).detach()
            else:
                self.link.send(y, dst=self.mesh.next_rank, header=m == 0)
        self.link.flush()
        self.module.train(was_training)
        return self._share_loss(loss_sum / micro)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full canonical state on rank 0; on other ranks, their own stage's entries."""
        own = {
            key: value.detach().to("cpu", copy=True)
            for key, value in self.slice.to_canonical(self.module.state_dict()).items()
        }
        gathered: list[Any] = [None] * dist.get_world_size() if comm.rank() == 0 else None
        dist.gather_object(own if self.mesh.replica == 0 else {}, gathered, dst=0)
        if comm.rank() != 0:
            return own
        full: dict[str, torch.Tensor] = {}
        for part in gathered:
            full.update(part)
        return full

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.module.load_state_dict(self.slice.from_canonical(state))

    # -- the schedule ---------------------------------------------------------------------

    def _stage_input(self, micro_inputs: list[Any], m: int, *, header: bool) -> torch.Tensor:
        if self.mesh.is_first:
            return micro_inputs[m].to(self._device)
        return self.link.recv_activation(src=self.mesh.prev_rank, header=header)

    def _run_round(self, inputs: Any, targets: Any, scale: float, *, last: bool) -> torch.Tensor:
        """One pass of the schedule over ``micro_batches`` micro-batches; returns the loss sum."""
        micro = self.micro_batches
        micro_in = split_micro(inputs, micro) if self.mesh.is_first else []
        micro_tgt = split_micro(targets, micro) if self.mesh.is_last else []
        held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        losses: list[torch.Tensor] = []
        actions = self.actions[self.mesh.stage]
        final_backward = max(i for i, a in enumerate(actions) if a.kind == "B")
        for position, action in enumerate(actions):
            m = action.micro
            if action.kind == "F":
                start = self._forward(m, micro_in, micro_tgt, held, losses, scale)
            else:
                arm = last and position == final_backward and self.reducer is not None
                start = self._backward(m, held, arm=arm)
            self.events.append(
                {
                    "step": self.steps_taken + 1,
                    "kind": "forward" if action.kind == "F" else "backward",
                    "micro": m,
                    "start": start,
                    "end": time.perf_counter(),
                }
            )
        self.link.flush()
        return torch.stack(losses).sum() if losses else torch.zeros((), device=self._device)

    def _forward(self, m, micro_in, micro_tgt, held, losses, scale: float) -> float:
        """Receive (or take) micro-batch ``m``, run the stage, pass the result on.

        Returns when the computation started, after the input arrived, so that waiting for
        a neighbour shows as idle time on the timeline, not as work.
        """
        x = self._stage_input(micro_in, m, header=m == 0)
        start = time.perf_counter()
        if x.is_floating_point() and not self.mesh.is_first:
            x.requires_grad_(True)
        with self.activations.record(m):
            if self.recompute:
                y = checkpoint(self.module, x, use_reentrant=False)
            else:
                y = self.module(x)
            if self.mesh.is_last:
                loss = self.loss_fn(y, micro_tgt[m].to(self._device))
                losses.append(loss.detach())
                y = loss * scale
        if not self.mesh.is_last:
            self.link.send(y, dst=self.mesh.next_rank, header=m == 0)
        held[m] = (x, y)
        return start

    def _backward(self, m, held, *, arm: bool) -> float:
        """Backward of micro-batch ``m`` once its output gradient arrived; send the input's."""
        x, y = held.pop(m)
        grad = None if self.mesh.is_last else self.link.recv_like(y, src=self.mesh.next_rank)
        start = time.perf_counter()
        if arm:  # the last backward of the step: let the gradient all-reduce start
            self.reducer.arm()
        with self.activations.record(m):
            if y.requires_grad:
                y.backward(grad)
        self.activations.release(m)
        if not self.mesh.is_first:
            self.link.send(x.grad, dst=self.mesh.prev_rank)
        return start

    def _share_loss(self, local: torch.Tensor) -> float:
        """The last stages' mean loss, averaged over replicas, on every rank."""
        value = (local if self.mesh.is_last else torch.zeros_like(local)).reshape(1)
        value = value / self.mesh.replicas
        comm.all_reduce_sum(value)
        return float(value[0])
