"""What a strategy is before any worker exists: the base every strategy's description fills.

The trainer, the command line, the configuration, the out-of-memory advice and the
planner ask these questions in the parent process (or in a worker before it builds its
engine): which options the strategy takes, how it lays out the devices (``layout``), what
it refuses, what a worker of it holds, what a layout would cost, what the summary says.
None of them needs a process group, so none lives on the runtime ``Engine``; the
registry maps a strategy's name to its description, and the description names the engine
class that runs it (``engine``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from paratrain.parallel.batching import check_divisible
from paratrain.parallel.cost_model import MachineCosts, ModelCosts, Prediction
from paratrain.parallel.cost_model import Run as PlanRun
from paratrain.parallel.layout import Layout
from paratrain.parallel.options import RunSpec, StrategyOption


class Strategy:
    """One strategy, described: a class of class-level answers (it is never instantiated).

    A new strategy subclasses it next to its engine (``<package>/description.py``), sets
    ``engine`` and ``options``, and registers it with ``@register("name")``; the defaults
    below describe a replicated model on every worker, each taking a share of the batch.
    """

    name: ClassVar[str]
    engine: ClassVar[type]
    """The runtime class (an ``Engine``, in ``strategy.py``, which imports this module)
    that ``create_engine`` builds in each worker."""

    options: ClassVar[tuple[StrategyOption, ...]] = ()
    """The strategy's own options (each also a keyword of ``engine``): the command line's
    flags and the run file's keys are generated from these."""

    independent_workers: ClassVar[bool] = False
    """True where no worker ever waits on another (ps): callers then never gather over the
    default group (a lost worker would hang it), and the run's throughput is the sum of the
    workers' own."""

    elastic: ClassVar[bool] = False
    """Whether ``--elastic`` may go on without a dead worker: only where every worker holds
    the whole model and optimizer state (see ``run/elastic``); elsewhere a dead worker
    takes state no other holds."""

    elastic_from_checkpoint: ClassVar[bool] = False
    """Whether ``--elastic`` may go on after a death by restarting the survivors from the
    newest checkpoint at their own count (``run/elastic_fallback``): where the layout is
    replicas only and the checkpoint loads at any count, but a dead worker takes state
    no other holds."""

    default: ClassVar[bool] = False
    """Whether a run that names no strategy takes this one (exactly one strategy does)."""

    advice_rank: ClassVar[int | None] = None
    """Where out-of-memory advice ranks this strategy, least sharded first (each step of
    sharding costs communication); None: never suggested."""

    @classmethod
    def elastic_in_memory(cls, options: dict[str, Any]) -> bool:
        """Whether ``--elastic`` goes on after a death from what the survivors hold, with
        these ``options`` (``elastic``, unless the strategy keeps copies of what a worker
        alone holds: zero2's ``shard_copies``); else from the checkpoint, if at all."""
        return cls.elastic

    @classmethod
    def layout(cls, devices: int, options: dict[str, Any]) -> Layout:
        """The degrees of a run on ``devices`` workers with ``options``: built here once,
        then carried to the mesh, the engine, the planner and the records."""
        return Layout.over(devices)

    @classmethod
    def micro_batches_per_step(cls, options: dict[str, Any]) -> int:
        """Micro-batches a replica splits its share into (beyond gradient accumulation)."""
        return 1

    @classmethod
    def check_run(cls, run: RunSpec) -> None:
        """Raise ``ValueError`` (one sentence saying what to change) for a run that cannot
        work: by default, degrees that do not fit the devices and a global batch that the
        replicas and micro-batches do not split."""
        check_divisible(
            run.global_batch,
            replicas=cls.layout(run.devices, run.options).replicas,
            micro_batches=run.gradient_accumulation * cls.micro_batches_per_step(run.options),
        )

    @classmethod
    def launch_options(cls, run: RunSpec) -> dict[str, Any]:
        """Engine keywords the run adds beyond the declared options (a sample, a timeout)."""
        return {}

    @classmethod
    def parameter_share(cls, workers: int, options: dict[str, Any]) -> float | None:
        """The smallest share of the parameters one worker holds (1.0: all of them; None:
        not modelled)."""
        return 1.0

    @classmethod
    def model_state_per_worker(
        cls,
        parameters: int,
        workers: int,
        options: dict[str, Any],
        *,
        weight: int = 4,
        gradient: int = 4,
        optimizer: int = 8,
    ) -> float | None:
        """Bytes of weights, gradients and optimizer state one worker holds, for
        ``parameters`` parameters at the given bytes per parameter (fp32 Adam by default):
        the worker's ``parameter_share`` of all of it; None where not modelled."""
        share = cls.parameter_share(workers, options)
        return None if share is None else (weight + gradient + optimizer) * share * parameters

    @classmethod
    def most_sharded_options(cls, workers: int) -> dict[str, Any]:
        """The options of this strategy's most sharded layout on ``workers`` (what
        out-of-memory advice assumes when it asks whether the strategy could fit); its
        defaults unless a degree shards the model further."""
        return {}

    @classmethod
    def summary_lines(cls, metrics: dict[str, Any]) -> list[str]:
        """Lines the run summary adds for what the engine's ``run_metrics`` returned."""
        return []

    @classmethod
    def machine_figures(cls) -> dict[str, float]:
        """Seconds of this strategy's own runtime on this machine that its ``predict``
        needs beyond the collectives (``MachineCosts.figure``), measured inside a job with
        the planner's collectives and cached with them: every worker calls it at the same
        point and gets the same figures. None by default."""
        return {}

    @classmethod
    def plan_layouts(cls, devices: int, *, layer_list: bool) -> list[dict[str, Any]]:
        """The option sets the planner proposes for this strategy on ``devices`` workers
        (``layer_list``: whether the model is one, which recompute and stages need); none
        by default: a strategy the planner does not model is never proposed."""
        return []

    @classmethod
    def predict(
        cls,
        costs_for: Callable[..., ModelCosts],
        machine: MachineCosts,
        run: PlanRun,
        options: dict[str, Any],
    ) -> Prediction | None:
        """One worker's ledger at its peak and the seconds of a step for this layout, from
        the measured costs (``costs_for(tensor)``: the model at that tensor degree;
        ``costs_for(tensor, True)``: a model that is no layer list per piece of the
        pipeline's cut at named blocks, a layer list as it is); None where the strategy
        does not model them."""
        return None


class DrawsTimeline:
    """Capability of a strategy whose engine records a timeline (``RecordsTimeline``):
    ``paratrain report`` asks the description to read and draw it."""

    @classmethod
    def summarize_timeline(cls, run_dir: str | Path) -> str:
        """The text ``paratrain report`` prints for a run's timeline."""
        raise NotImplementedError

    @classmethod
    def report_timeline(
        cls, run_dir: str | Path, *, out_dir: str | Path | None = None
    ) -> dict[str, Path]:
        """Write the run's timeline pictures and traces; returns what was written, by kind."""
        raise NotImplementedError
