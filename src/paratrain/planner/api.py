"""``paratrain.plan`` and ``paratrain.predict``: how to split a model over these devices.

``plan`` measures the model once per precision and tensor degree on one process
(``measure``), takes this machine's collectives from the cache or measures them
(``machine``), asks every registered strategy for its layouts and its prediction of each
(``Strategy.plan_layouts``, ``Strategy.predict``), and ranks them (``choose``). ``predict``
does the same for one layout the caller fixes. Inside a job (``setup(strategy="auto")``)
``plan_in_job`` plans on rank 0, every worker taking part in the collective
measurements, and hands every worker the same answer.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.parallel.batching import batch_size
from paratrain.parallel.cost_model import MachineCosts, ModelCosts, Run
from paratrain.parallel.layers import is_layer_list, layer_list
from paratrain.parallel.options import RunSpec
from paratrain.parallel.piece_runs import block_count
from paratrain.parallel.registry import strategy_class, strategy_names
from paratrain.parallel.strategy import engine_options
from paratrain.parallel.tensor.options import PLAN_KEYWORD
from paratrain.planner import cost_cache
from paratrain.planner.choose import Candidate, Plan, rank
from paratrain.planner.machine import cores, machine_costs
from paratrain.planner.measure import measure_model, measure_optimizer
from paratrain.runtime import comm
from paratrain.runtime.launch import default_device_count
from paratrain.runtime.units import parse_size

ACCUMULATIONS = (1, 2, 4)
"""Gradient accumulation tried where the caller leaves it open."""


class ModelMeasurements:
    """The model's costs, measured when first asked for, per (precision, tensor degree),
    or read from the files an earlier measurement of the same model on this machine
    wrote (``cost_cache``; ``refresh`` measures again)."""

    def __init__(
        self,
        model: nn.Module,
        sample: tuple[Any, Any],
        *,
        loss_fn: Callable,
        optimizer: Callable,
        split_plan: dict[str, str] | None = None,
        worker_threads: int | None = None,
        refresh: bool = False,
    ) -> None:
        self.model, self.sample, self.loss_fn = model, sample, loss_fn
        self._cut_at_blocks = not is_layer_list(model)  # what ``pieces`` measures
        self.split_plan = split_plan
        self.worker_threads = worker_threads
        self.refresh = refresh
        self.optimizer = cost_cache.cached(
            "optimizer",
            [
                cost_cache.optimizer_fingerprint(optimizer),
                cost_cache.machine_fingerprint(worker_threads),
            ],
            refresh,
            lambda: measure_optimizer(optimizer, worker_threads=worker_threads),
            dataclasses.asdict,
            cost_cache.optimizer_from_json,
        )
        self._costs: dict[tuple[str, int, bool], ModelCosts | ValueError] = {}
        self._fingerprint: list[Any] | None = None

    def costs(self, precision: str, tensor: int, pieces: bool = False) -> ModelCosts:
        """``pieces``: a model that is no layer list, per piece of the pipeline's cut
        before every block (``ModelCosts.pieces``) rather than whole; a layer list is
        measured per layer either way."""
        pieces = pieces and self._cut_at_blocks
        key = (precision, tensor, pieces)
        if key not in self._costs:
            try:
                self._costs[key] = self._cached(precision, tensor, pieces)
            except ValueError as error:  # a split the model cannot take
                self._costs[key] = error
        found = self._costs[key]
        if isinstance(found, ValueError):
            raise found
        return found

    def _cached(self, precision: str, tensor: int, pieces: bool) -> ModelCosts:
        if self._fingerprint is None:  # the model's, once: the sources are read per class
            self._fingerprint = [
                cost_cache.model_fingerprint(self.model),
                cost_cache.sample_fingerprint(self.sample),
                cost_cache.fingerprint_of(self.loss_fn),
                cost_cache.machine_fingerprint(self.worker_threads),
            ]
        return cost_cache.cached(
            "model",
            [*self._fingerprint, precision, tensor, self.split_plan, *(["pieces"] * pieces)],
            self.refresh,
            lambda: measure_model(
                self.model,
                self.sample,
                loss_fn=self.loss_fn,
                optimizer=self.optimizer,
                precision=precision,
                tensor=tensor,
                split_plan=self.split_plan,
                worker_threads=self.worker_threads,
                pieces=pieces,
            ),
            cost_cache.costs_to_json,
            lambda data: cost_cache.costs_from_json(data, self.optimizer),
        )


ENUMERATED = ("stages", "micro_batches", "schedule", "tensor", "recompute")
"""Options the layouts search over: one the caller fixes keeps only the layouts with it."""


def _agrees(name: str, layout: dict[str, Any], fixed: dict[str, Any]) -> dict[str, Any] | None:
    """``layout`` with the caller's fixed options, or None where it has another value of an
    option the layouts search over, or the strategy does not take a fixed option."""
    cls = strategy_class(name)
    accepted = set(engine_options(cls.engine))
    defaults = {option.name: option.default for option in cls.options}
    for key, value in fixed.items():
        if key not in accepted:
            return None
        if key in ENUMERATED and layout.get(key, defaults.get(key)) != value:
            return None
    return {**layout, **fixed}


def _pieces(cls: Any, devices: int, options: dict[str, Any]) -> int:
    """The pieces a layout cuts the layer list into: its stages times their virtual stages
    (0 where its degrees do not fit: ``check_run`` then refuses it with its sentence)."""
    try:
        layout = cls.layout(devices, options)
    except ValueError:
        return 0
    return layout.stages * layout.virtual_stages


def candidates(
    model: nn.Module,
    *,
    devices: int,
    global_batch: int,
    strategies: Iterable[str],
    accumulations: Iterable[int],
    precisions: Iterable[str],
    fixed: dict[str, Any],
) -> list[Candidate]:
    """Every valid (strategy, options, accumulation, precision) for this run; a layout whose
    mesh or batch split the strategy refuses is never proposed."""
    listed = is_layer_list(model)
    layers = len(layer_list(model)[0]) if listed else block_count(model)
    out = []
    for name in strategies:
        cls = strategy_class(name)
        for layout in cls.plan_layouts(devices, layer_list=listed):
            options = _agrees(name, layout, fixed)
            if options is None or _pieces(cls, devices, options) > layers:
                continue
            for accumulation, precision in itertools.product(accumulations, precisions):
                spec = RunSpec(
                    devices=devices,
                    global_batch=global_batch,
                    gradient_accumulation=accumulation,
                    options=options,
                )
                try:
                    cls.check_run(spec)
                except ValueError:
                    continue
                out.append(Candidate(name, dict(options), accumulation, precision))
    return out


def evaluate(
    found: list[Candidate],
    measurements: ModelMeasurements,
    machine: MachineCosts,
    *,
    devices: int,
    global_batch: int,
    budget: int | None,
) -> None:
    """Fill each candidate's prediction, or the reason it has none."""
    for candidate in found:
        run = Run(
            devices=devices,
            global_batch=global_batch,
            gradient_accumulation=candidate.gradient_accumulation,
            precision=candidate.precision,
            budget=budget,
        )
        try:
            candidate.prediction = strategy_class(candidate.strategy).predict(
                lambda tensor, pieces=False, p=candidate.precision: measurements.costs(
                    p, tensor, pieces
                ),
                machine,
                run,
                candidate.options,
            )
        except ValueError as error:
            candidate.invalid = str(error)
        if candidate.prediction is None and candidate.invalid is None:
            candidate.invalid = "this strategy's memory and time are not modelled"


def _as_tuple(value: Any, default: Iterable) -> tuple:
    if value is None:
        return tuple(default)
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return (value,)


def plan(
    model: nn.Module,
    *,
    global_batch: int,
    optimizer: Callable,
    loss_fn: Callable,
    sample: tuple[Any, Any],
    devices: int | None = None,
    memory_per_device: str | int | None = None,
    precision: str | tuple[str, ...] = "fp32",
    gradient_accumulation: int | tuple[int, ...] | None = None,
    strategy: str | tuple[str, ...] | None = None,
    machine: MachineCosts | None = None,
    refresh: bool = False,
    **fixed: Any,
) -> Plan:
    """The fastest plan predicted to fit ``memory_per_device`` on ``devices`` workers.

    ``sample`` is one batch of (inputs, targets): the global batch, or a smaller one whose
    costs are scaled to each plan's micro-batch. Any option ``setup`` takes may be fixed
    (``stages=4``, ``strategy="pipeline"``, ``precision=("fp32", "bf16")`` to allow
    both, the plan of split layers); the rest is searched. Raises ``NoPlanFits`` (which
    names the smallest need) where nothing fits. What was measured is kept per machine
    (``cost_cache``, ``machine``); ``refresh=True`` measures the model and the machine
    again.
    """
    devices = devices or default_device_count()
    budget = parse_size(memory_per_device)
    found = candidates(
        model,
        devices=devices,
        global_batch=global_batch,
        strategies=_as_tuple(strategy, strategy_names()),
        accumulations=_as_tuple(gradient_accumulation, ACCUMULATIONS),
        precisions=_as_tuple(precision, ("fp32",)),
        fixed=fixed,
    )
    if not found:
        raise ValueError(
            f"no strategy can split this run ({devices} devices, global batch "
            f"{global_batch}) with the options fixed ({fixed or 'none'}); relax them, or "
            "choose a global batch that the devices divide."
        )
    measurements = _measurements(model, sample, loss_fn, optimizer, fixed, devices, refresh)
    machine = machine or machine_costs(devices, refresh=refresh)
    evaluate(
        found, measurements, machine, devices=devices, global_batch=global_batch, budget=budget
    )
    chosen = rank(found, budget, devices)
    return Plan.of(chosen, found, devices=devices, global_batch=global_batch, budget=budget)


def predict(
    model: nn.Module,
    *,
    strategy: str,
    global_batch: int,
    optimizer: Callable,
    loss_fn: Callable,
    sample: tuple[Any, Any],
    devices: int | None = None,
    memory_per_device: str | int | None = None,
    precision: str = "fp32",
    gradient_accumulation: int = 1,
    machine: MachineCosts | None = None,
    refresh: bool = False,
    **options: Any,
) -> Plan:
    """The prediction for one layout the caller fixes (a ``Plan`` with that one candidate;
    its ``table()`` says whether it fits the budget)."""
    devices = devices or default_device_count()
    cls = strategy_class(strategy)
    cls.check_run(
        RunSpec(
            devices=devices,
            global_batch=global_batch,
            gradient_accumulation=gradient_accumulation,
            options=options,
        )
    )
    candidate = Candidate(strategy, dict(options), gradient_accumulation, precision)
    budget = parse_size(memory_per_device)
    measurements = _measurements(model, sample, loss_fn, optimizer, options, devices, refresh)
    evaluate(
        [candidate],
        measurements,
        machine or machine_costs(devices, refresh=refresh),
        devices=devices,
        global_batch=global_batch,
        budget=budget,
    )
    if candidate.prediction is None:
        raise ValueError(f"cannot predict {strategy} for this model: {candidate.invalid}")
    try:
        rank([candidate], budget, devices)
    except ValueError:
        pass  # over budget: the verdict says by how much
    return Plan.of(
        candidate, [candidate], devices=devices, global_batch=global_batch, budget=budget
    )


def _measurements(
    model: nn.Module,
    sample: tuple[Any, Any],
    loss_fn: Callable,
    optimizer: Callable,
    options: dict[str, Any],
    devices: int,
    refresh: bool = False,
) -> ModelMeasurements:
    """The model's costs as a worker of ``devices`` would run it (its plan of split
    layers, if the options give one)."""
    return ModelMeasurements(
        model,
        sample,
        loss_fn=loss_fn,
        optimizer=optimizer,
        split_plan=options.get(PLAN_KEYWORD),
        worker_threads=worker_threads(devices),
        refresh=refresh,
    )


def worker_threads(devices: int) -> int:
    """The intra-op threads the launcher gives each of ``devices`` local workers; inside a
    job the worker's own."""
    if comm.distributed():
        return torch.get_num_threads()
    return max(1, cores() // devices)


def plan_in_job(model: nn.Module, **arguments: Any) -> Plan:
    """``plan`` inside a job: every worker joins the collective measurements, rank 0
    measures the model and chooses, and every worker gets its answer."""
    devices = comm.world_size()
    machine = machine_costs(devices)
    chosen: list[Any] = [None]
    if comm.rank() == 0:
        chosen[0] = plan(model, devices=devices, machine=machine, **arguments)
    dist.broadcast_object_list(chosen, src=0)
    return chosen[0]


def sample_size(sample: tuple[Any, Any]) -> int:
    return batch_size(sample[0])
