"""The runtime Engine contract every strategy implements: what runs a step, and its hooks.

What a strategy says before any worker exists is its description (``description.py``).
The trainer and the user's loop talk only to this interface, so they never ask which
strategy runs them. An engine receives the GLOBAL batch on every rank and takes the share
it needs; it returns full state in canonical names (the single-device model's own keys).
"""

from __future__ import annotations

import inspect
import json
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from paratrain.parallel.checkpointing import load_engine_checkpoint, save_engine_checkpoint
from paratrain.parallel.cost_model import CATEGORIES
from paratrain.parallel.description import Strategy
from paratrain.parallel.engine_settings import EngineSettings, LossFn, OptimizerFactory
from paratrain.parallel.layout import Layout
from paratrain.parallel.memory_tracking import MemoryTracker
from paratrain.parallel.metric_tally import Metric, ObservedLoss, Tally
from paratrain.parallel.model_config import model_config, with_model_config
from paratrain.parallel.precision import Precision
from paratrain.parallel.registry import strategy_class, strategy_names
from paratrain.parallel.ties import tied_names
from paratrain.runtime import comm
from paratrain.runtime.devices import current_device
from paratrain.runtime.memory import model_state_bytes


@dataclass(frozen=True)
class StepStats:
    """What one optimizer step reports; identical on every rank except ``comm_bytes``."""

    loss: float
    """Mean loss over the whole global batch."""
    step: int
    """Optimizer steps taken so far, this one included."""
    samples: int
    """Samples in the global batch."""
    comm_bytes: int = 0
    """Payload bytes this worker handed to collectives during the step."""
    skipped_steps: int = 0
    """Steps skipped so far because fp16 gradients overflowed (``step`` counts them too)."""
    loss_scale: float = 1.0
    """The fp16 loss scale after this step (1.0 for fp32 and bf16)."""
    grad_norm: float | None = None
    """The global gradient norm before clipping, where ``max_grad_norm`` clips."""


class Engine(ABC):
    """One parallel strategy behind one small interface.

    Subclasses declare their strategy-specific options as keyword-only ``__init__``
    parameters; ``create_engine`` refuses any other keyword with one clear sentence.

    Options every engine takes (subclasses pass them on to this ``__init__``):
    ``precision`` ("fp32", "bf16", "fp16" or a ``Precision``) gives ``self.precision``
    (autocast, fp16 loss scaling); ``memory_per_device`` ("2GiB", bytes) gives the budget
    of ``self.memory``, the worker's memory ledger. An engine adopts both with a few calls
    (see ``precision.py`` and ``memory_tracking.py``; ``dp/engine.py`` is the model).

    What is asked before any worker starts (options, checks, memory and time arithmetic,
    candidate layouts, summary lines) is the strategy's description (``description.py``,
    ``self.strategy``); an engine only runs. ``layout`` (the run's degrees, built once by
    the description) is passed by ``create_engine``, never by the user.
    """

    name: ClassVar[str]
    strategy: ClassVar[type[Strategy]]
    """The description this engine runs (set by ``register``)."""

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
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}.")
        self.settings = EngineSettings(
            optimizer=optimizer,
            loss_fn=loss_fn,
            gradient_accumulation=gradient_accumulation,
            precision=precision,
            memory_per_device=memory_per_device,
            max_grad_norm=max_grad_norm,
        )
        self.degrees = layout
        """The run's degrees, as the description laid them out (``create_engine``)."""
        self.loss_fn = loss_fn
        self.gradient_accumulation = gradient_accumulation
        self.max_grad_norm = self.settings.max_grad_norm
        self._grad_norm: float | None = None  # the last step's, where clipping is on
        self.steps_taken = 0
        self._device = current_device()
        self.precision = Precision.of(precision)
        self.model_config = model_config(model)  # the whole model's, saved with checkpoints
        # Counted before a strategy moves layers away or shards them: the whole model.
        total_parameters = sum(p.numel() for p in dict.fromkeys(model.parameters()))
        self.memory = MemoryTracker(
            strategy=getattr(self, "name", type(self).__name__),
            device=self._device,
            memory_per_device=memory_per_device,
            total_parameters=total_parameters,
            candidates=strategy_names,
        )

    # -- what the description says, read by the running engine ------------------------------

    @property
    def independent_workers(self) -> bool:
        """Whether no worker ever waits on another (see ``Strategy.independent_workers``)."""
        return self.strategy.independent_workers

    def run_metrics(self) -> dict[str, Any] | None:
        """Strategy-specific figures for the run summary and metrics file (None: none)."""
        return None

    def finish_training(self) -> None:  # noqa: B027 (optional hook, nothing by default)
        """Called by the trainer after the last step, before the final checkpoint."""

    def close(self) -> None:  # noqa: B027 (optional hook, nothing by default)
        """Release what the engine started (processes, shared memory); the trainer calls
        it once the run is over."""

    @property
    def device(self) -> torch.device:
        """Where this worker computes: its own GPU under NCCL, else the CPU."""
        return self._device

    @property
    def parameter_bytes(self) -> int:
        """Bytes of model parameters this worker holds (all of them unless sharded or split)."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this worker holds."""
        return model_state_bytes(self.model.parameters(), self.optimizer)

    @property
    def rank(self) -> int:
        """This worker's rank in the whole job (0 outside one)."""
        return comm.rank()

    @property
    def world_size(self) -> int:
        """Workers taking part in this engine."""
        return 1

    def _step_stats(self, loss: float, samples: int, comm_bytes: int = 0) -> StepStats:
        """The step just taken (``steps_taken`` already counts it), with the precision's
        skip count and loss scale, which every engine reports the same way."""
        return StepStats(
            loss=loss,
            step=self.steps_taken,
            samples=samples,
            comm_bytes=comm_bytes,
            skipped_steps=self.precision.skipped_steps,
            loss_scale=self.precision.scale,
            grad_norm=self._grad_norm,
        )

    @abstractmethod
    def train_step(self, inputs: Any, targets: Any) -> StepStats:
        """One optimizer step on the global batch (identical on every rank)."""

    @abstractmethod
    def eval_step(self, inputs: Any, targets: Any) -> float:
        """Mean loss over the global batch, changing nothing."""

    # -- metrics read off the predictions (see ``metric_tally``) -----------------------------

    def tally(self, metric: Metric) -> Tally:
        """A tally open from now on: every (outputs, targets) pair this worker's loss sees,
        in ``train_step`` and ``eval_step`` alike, also goes to ``metric``, whose values
        it sums, until ``close()`` (or a ``with`` block's end). The newest open tally
        takes the pairs."""
        if not isinstance(self.loss_fn, ObservedLoss):
            self.loss_fn = ObservedLoss(self.loss_fn)
        return Tally(metric, self.loss_fn)

    def tally_totals(self, tally: Tally) -> dict[str, float]:
        """The tally's sums over every batch this engine's workers saw while it was open,
        by field. Every worker calls it: where the workers split the batch it is a
        collective (``combine_tally``)."""
        sums = self.combine_tally(tally.sums.clone())
        return dict(zip(tally.metric.fields, sums.cpu().tolist(), strict=True))

    def combine_tally(self, sums: torch.Tensor) -> torch.Tensor:
        """This worker's sums made the whole batch's. An engine whose workers each see a
        part of the batch adds them up over those workers (``sum_over_workers``); the
        default serves an engine alone in its job and refuses a guess in any other."""
        if comm.distributed() and comm.world_size() > 1:
            raise NotImplementedError(
                f"{type(self).__name__} does not say how its workers' metric sums add up; "
                "override combine_tally to sum them over the workers that split the batch."
            )
        return sums

    def sum_over_workers(self, sums: torch.Tensor, group: Any = None) -> torch.Tensor:
        """``sums`` added over ``group`` (None: every worker), through this worker's device
        (NCCL reduces device tensors only); returned on the CPU."""
        moved = sums.to(self._device)
        comm.all_reduce_sum(moved, group=group)
        return moved.cpu()

    @abstractmethod
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full model state in canonical names, as CPU tensors (at least on rank 0)."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a full canonical model state (as ``state_dict`` returns)."""

    def memory_report(self) -> dict[str, dict[str, int]]:
        """This worker's ledger: ``{category: {"current": bytes, "peak": bytes}, ...,
        "total": {"current": bytes, "peak": bytes}}``, the total's peak being the highest
        sum booked at one moment (what the planner's ``predicted_peak_bytes`` predicts;
        a run reaches it from its second step)."""
        ledger = self.memory.ledger
        report = {
            category: {"current": ledger.current[category], "peak": ledger.peak[category]}
            for category in CATEGORIES
        }
        report["total"] = {"current": ledger.total, "peak": ledger.peak_total}
        return report

    # -- checkpoints ------------------------------------------------------------------------

    optimizer: torch.optim.Optimizer | None

    def save_checkpoint(self, path: str | Path, *, metadata: dict[str, Any] | None = None) -> Path:
        """Save model, optimizer state, step and RNG in canonical names; every worker calls it.

        The folder appears atomically once complete; ``metadata`` (JSON) rides along, e.g.
        the data loader's position.
        """
        if self.precision.scales_loss:  # the fp16 loss scale is the same on every worker
            metadata = {**(metadata or {}), "precision": self.precision.state_dict()}
        metadata = with_model_config(metadata, self.model_config)
        return save_engine_checkpoint(self, path, metadata=metadata)

    def load_checkpoint(self, path: str | Path):
        """Load a checkpoint saved by any engine at any device count; every worker calls it.

        Returns the verified ``Checkpoint`` (its ``metadata`` holds what was saved with it).
        """
        checkpoint = load_engine_checkpoint(self, path)
        saved = checkpoint.metadata.get("precision")
        if saved and saved.get("name") == self.precision.name:
            self.precision.load_state_dict(saved)
        return checkpoint

    def named_local_state(self) -> dict[str, torch.Tensor]:
        """The model tensors this worker holds, live, under canonical names."""
        return self.model.state_dict()

    def named_local_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This worker's parameters under canonical names (to key optimizer state)."""
        return list(self.model.named_parameters())

    def tied_names(self) -> dict[str, str]:
        """``{alias: canonical}`` for the whole model's tied names (see ``ties``); the
        same on every worker, whichever part of the model it holds."""
        return tied_names(self.model)

    def writes_shard(self) -> bool:
        """Whether this worker writes its model and optimizer state when saving.

        Replicas hold the same state, so only one of them writes it.
        """
        return comm.rank() == 0

    def covers_whole_model(self) -> bool:
        """Whether this worker holds every model tensor (not a stage or a shard)."""
        return True

    def layout(self) -> dict[str, Any]:
        """How the state is laid out over workers, recorded in each checkpoint's manifest."""
        return {"strategy": self.name, "world_size": comm.world_size()}


TIMELINE_FILE = "timeline.jsonl"
"""The run folder's timeline of an engine that records one (``RecordsTimeline``)."""


class RecordsTimeline:
    """Mixin for engines that time each forward and backward (pipeline schedules).

    The trainer calls ``write_timeline``, which writes the run's ``timeline.jsonl``; the
    strategy's description (``description.DrawsTimeline``) draws it in ``paratrain
    report``. Engines without the mixin simply have no timeline.
    """

    events: list[dict[str, Any]]
    steps_taken: int

    def timeline_meta(self) -> dict[str, Any]:
        """Header of the timeline file (schedule, stages, micro-batches, replicas)."""
        raise NotImplementedError

    def timeline_identity(self) -> dict[str, Any]:
        """Fields added to each of this worker's events (rank, stage, replica)."""
        raise NotImplementedError

    def activation_peak_bytes(self) -> int:
        """Peak bytes of activations held for backward on this worker."""
        raise NotImplementedError

    def records_timeline(self) -> bool:
        """Whether this worker's events go into the timeline (workers that run the same
        schedule in lockstep, a tensor group's, leave it to one of them)."""
        return True

    def write_timeline(self, run_dir: str | Path, *, last_steps: int) -> None:
        """Gather every worker's events of the last ``last_steps`` steps to rank 0, which
        writes ``timeline.jsonl`` into ``run_dir``; every worker calls it."""
        first_step = self.steps_taken - last_steps
        identity = self.timeline_identity()
        own = {
            "events": [{**identity, **e} for e in self.events if e["step"] > first_step],
            "peak": {**identity, "kind": "activation_peak", "bytes": self.activation_peak_bytes()},
        }
        if not self.records_timeline():
            own = {"events": [], "peak": None}
        gathered = [None] * comm.world_size() if comm.rank() == 0 else None
        dist.gather_object(own, gathered, dst=0)
        if comm.rank() != 0:
            return
        with (Path(run_dir) / TIMELINE_FILE).open("w") as handle:
            handle.write(json.dumps({"kind": "meta", **self.timeline_meta()}) + "\n")
            for part in gathered:
                for event in part["events"]:
                    handle.write(json.dumps(event) + "\n")
                if part["peak"] is not None:
                    handle.write(json.dumps(part["peak"]) + "\n")


def wants_names(factory: OptimizerFactory) -> bool:
    """Whether an optimizer factory asks for (name, parameter) pairs: its first parameter is
    called ``named_parameters`` (to group parameters by name, e.g. no weight decay on
    biases and norms)."""
    try:
        parameters = list(inspect.signature(factory).parameters)
    except (TypeError, ValueError):  # a builtin or C callable: it takes plain parameters
        return False
    return bool(parameters) and parameters[0] == "named_parameters"


def optimizer_from_factory(
    factory: OptimizerFactory, named: Iterable[tuple[str, nn.Parameter]]
) -> torch.optim.Optimizer:
    """``factory`` over this worker's parameters, with their canonical names if it asks."""
    named = list(named)
    return factory(named) if wants_names(factory) else factory([p for _, p in named])


def require_process_group(strategy: str) -> None:
    """Refuse a distributed strategy outside a launched job, saying what to do instead."""
    if not comm.distributed():
        raise RuntimeError(
            f"strategy {strategy!r} needs worker processes: call paratrain.setup inside a "
            "function run by paratrain.launch(...) or under torchrun, or use strategy='single'."
        )
    if str(dist.get_backend()) == "nccl":
        raise RuntimeError(
            f"strategy {strategy!r} also exchanges small CPU tensors (seeds, counters), which a "
            "process group of NCCL alone refuses: make it with "
            "dist.init_process_group('cpu:gloo,cuda:nccl'), or let paratrain.launch or "
            "paratrain train make it."
        )


def engine_options(cls: type[Engine]) -> list[str]:
    """Keyword options an engine accepts, shared and strategy-specific (``layout`` is the
    description's to give, not an option)."""
    names: list[str] = []
    for klass in cls.__mro__:
        if klass is object or "__init__" not in vars(klass):
            continue
        for param in inspect.signature(klass.__init__).parameters.values():
            if param.kind is inspect.Parameter.KEYWORD_ONLY and param.name not in {
                *names,
                "layout",
            }:
                names.append(param.name)
    return names


def create_engine(strategy: str, model: nn.Module, **options: Any) -> Engine:
    """Build the engine of the strategy registered as ``strategy`` on this job's workers,
    refusing unknown names and options; its layout is laid out here, once."""
    description = strategy_class(strategy)
    cls = description.engine
    accepted = engine_options(cls)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(
            f"strategy {strategy!r} does not take option(s) {', '.join(unknown)}; "
            f"it accepts: {', '.join(accepted)}."
        )
    layout = description.layout(comm.world_size(), options)
    engine = cls(model, layout=layout, **options)
    if options.get("memory_per_device") is not None and not engine.memory.watching:
        raise ValueError(
            f"strategy {strategy!r} keeps no memory ledger yet, so it cannot hold a worker to "
            "memory_per_device; leave that option out for this strategy."
        )
    return engine
