"""``pipeline`` described before any worker starts: its layout, refusals, costs, report.

The stage count and the tensor degree come from the options once (``layout``); the checks
cut a meta-device copy of the model as the engine would (layers per stage, split points,
recompute, the tensor plan), so a run that cannot be cut is refused before launch.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import product
from pathlib import Path
from typing import Any

from paratrain.parallel.cost_model import divisors
from paratrain.parallel.description import DrawsTimeline, Strategy
from paratrain.parallel.layers import is_layer_list, layer_list
from paratrain.parallel.layout import Layout
from paratrain.parallel.options import RunSpec, given
from paratrain.parallel.pipeline import cost as pipeline_cost
from paratrain.parallel.pipeline import runner_probe, timeline_report
from paratrain.parallel.pipeline.cost import MICRO_BATCH_FIGURE, SPLIT_MICRO_BATCH_FIGURE
from paratrain.parallel.pipeline.engine import PipelineEngine
from paratrain.parallel.pipeline.options import (
    BALANCE,
    BALANCE_BY,
    MICRO_BATCHES,
    OPTIONS,
    SCHEDULE,
    SPLIT_POINTS,
    STAGES,
    VIRTUAL_STAGES,
    micro_batches_per_replica,
)
from paratrain.parallel.pipeline.partition import check_stages, validate_balance
from paratrain.parallel.pipeline.schedules import SPLIT_SCHEDULES, build_schedule
from paratrain.parallel.pipeline.split_points import (
    layer_list_balance,
    plan_stages,
    refuse_for_split_points,
    refuse_splits_across_stages,
)
from paratrain.parallel.recompute import RECOMPUTE, refuse_batchnorm
from paratrain.parallel.registry import register
from paratrain.parallel.tensor.compose import SplitsLayersStrategy
from paratrain.parallel.tensor.options import PLAN_KEYWORD
from paratrain.parallel.tensor.plan import resolve_plan

PROPOSED_SCHEDULES = (("1f1b", 1), ("gpipe", 1), ("zb-h1", 1), ("zb-h2", 1), ("1f1b", 2))
"""(schedule, chunks per stage) the planner considers; see ``plan_layouts``."""


@register("pipeline")
class PipelineStrategy(DrawsTimeline, SplitsLayersStrategy, Strategy):
    """Stages of the model on consecutive workers (see ``PipelineEngine`` for the options)."""

    engine = PipelineEngine
    options = OPTIONS
    advice_rank = 4  # after zero3: its stages cut at layers or named blocks

    @classmethod
    def layout(cls, devices: int, options: dict[str, Any]) -> Layout:
        layout = Layout.over(
            devices, stages=given(options, STAGES), tensor=cls.tensor_degree(devices, options)
        )
        return replace(layout, virtual_stages=given(options, VIRTUAL_STAGES))

    @classmethod
    def micro_batches_per_step(cls, options: dict[str, Any]) -> int:
        return micro_batches_per_replica(given(options, STAGES), options.get(MICRO_BATCHES.name))

    @classmethod
    def check_run(cls, run: RunSpec) -> None:
        """The mesh and batch, then the stages against the model's layers (on a meta copy)."""
        super().check_run(run)
        layout = cls.layout(run.devices, run.options)
        chunks, schedule = layout.virtual_stages, given(run.options, SCHEDULE)
        # refuses a schedule the stages and micro-batches cannot run
        build_schedule(schedule, layout.stages, cls.micro_batches_per_step(run.options), chunks)
        if run.build_model is None:
            return
        stages, balance = layout.stages * chunks, run.options.get(BALANCE.name)
        split_points = run.options.get(SPLIT_POINTS.name)
        model = run.build_model()
        if layout.tp_enabled:
            cls.check_tensor_plan(run, layout.tensor)
        if split_points is not None and is_layer_list(model):
            balance = layer_list_balance(model, split_points, stages)
        elif not is_layer_list(model):
            refuse_for_split_points(
                balance=balance,
                balance_by=given(run.options, BALANCE_BY),
                recompute=given(run.options, RECOMPUTE),
            )
            stage_plan = plan_stages(model, stages, split_points, virtual_stages=chunks)
            if layout.tp_enabled:
                tensor_plan = resolve_plan(model, layout.tensor, run.options.get(PLAN_KEYWORD))
                refuse_splits_across_stages(stage_plan, tensor_plan)
            return
        model_layers = layer_list(model)[0]
        if given(run.options, RECOMPUTE):
            refuse_batchnorm(model_layers)
        layers = len(model_layers)
        check_stages(layers, stages)
        if balance is not None:
            validate_balance(balance, layers=layers, stages=stages)

    @classmethod
    def launch_options(cls, run: RunSpec) -> dict[str, Any]:
        """Balancing by time or memory measures the layers on one micro-batch of inputs."""
        if given(run.options, BALANCE_BY) not in ("time", "memory") or run.sample_inputs is None:
            return {}
        size = max(1, run.global_batch // cls.micro_batches_per_step(run.options))
        return {"sample_input": run.sample_inputs(size)}

    @classmethod
    def summarize_timeline(cls, run_dir: str | Path) -> str:
        return timeline_report.summarize(run_dir)

    @classmethod
    def report_timeline(
        cls, run_dir: str | Path, *, out_dir: str | Path | None = None
    ) -> dict[str, Path]:
        return timeline_report.report(run_dir, out_dir=out_dir)

    @classmethod
    def parameter_share(cls, workers: int, options: dict[str, Any]) -> float:
        """A stage holds at least 1/stages of the model only if its layers balance, and of
        that 1/tensor where every layer splits: a lower bound, for refusing a budget before
        any worker starts (so also the model state a worker holds: replicas hold copies)."""
        layout = cls.layout(workers, options)
        return 1.0 / layout.tensor / layout.stages

    @classmethod
    def most_sharded_options(cls, workers: int) -> dict[str, Any]:
        """One stage per worker: each holds 1/workers of balanced layers."""
        return {STAGES.name: workers}

    @classmethod
    def summary_lines(cls, metrics: dict[str, Any]) -> list[str]:
        return cls.split_summary_lines(metrics)

    @classmethod
    def plan_layouts(cls, devices: int, *, layer_list: bool) -> list[dict[str, Any]]:
        """Every stage count (2 and up) that divides the workers, with 1, 2 and 4
        micro-batches per stage, each schedule of ``PROPOSED_SCHEDULES``, every tensor
        degree of the rest, each with and without recompute. A model cut at named blocks
        (no layer list) is priced per piece of its cut before every block
        (``parallel/piece_runs``), so it gets the same layouts but for recompute, which its
        pipeline refuses.

        ZB-H1 and ZB-H2 are proposed since their prediction counts what the split backward
        keeps from B to W (``split_cost``; on a 2-worker gpt at 2 micro-batches it was 20%
        under the live count without it, 4% under with it). Interleaved 1F1B (2 virtual
        stages; layouts cutting more pieces than the model has layers are dropped by the
        planner) is proposed since its live peak is what its prediction says: it had been
        2.8-4.5% under on a 2-stage mlp while flattening an activation left a reference
        cycle that kept a round's activations alive until Python's cyclic collector ran
        (``structure.flatten``), 17.5% over under recompute while a backward was counted
        over both chunks at once, and 13% over on a 2-block gpt whose embedding chunk was
        priced as half a stage (each chunk is counted on its own now: ``chunk_cost``)."""
        schedules = PROPOSED_SCHEDULES
        layouts = []
        for stages in (s for s in divisors(devices) if s >= 2):
            for tensor in divisors(devices // stages):
                for micro in (stages, 2 * stages, 4 * stages):
                    for (schedule, chunks), recompute in product(schedules, (False, True)):
                        if recompute and (schedule in SPLIT_SCHEDULES or not layer_list):
                            continue  # its per-layer recompute: not held against live memory
                        layout = {"stages": stages, "micro_batches": micro}
                        if schedule != "1f1b":
                            layout["schedule"] = schedule
                        if chunks > 1:
                            layout["virtual_stages"] = chunks
                        if tensor > 1:
                            layout["tensor"] = tensor
                        if recompute:
                            layout["recompute"] = True
                        layouts.append(layout)
        return layouts

    @classmethod
    def machine_figures(cls) -> dict[str, float]:
        """Its runner's seconds per micro-batch (``runner_probe``), and under a zero-
        bubble schedule's split backward."""
        found = runner_probe.micro_batch_seconds(("gpipe", "zb-h1"))
        return {MICRO_BATCH_FIGURE: found["gpipe"], SPLIT_MICRO_BATCH_FIGURE: found["zb-h1"]}

    @classmethod
    def predict(cls, costs_for, machine, run, options):
        """A model that is no layer list is priced per piece of its cut at named blocks
        (``ModelCosts.pieces``), as its stages hold and run them; a layer list per layer."""
        layout = cls.layout(run.devices, options)
        return pipeline_cost.predict(
            costs_for(layout.tensor, True), costs_for(1, True), machine, run, options, layout=layout
        )
