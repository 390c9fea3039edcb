"""``ps`` described before any worker starts: where it may run, what it refuses, its summary.

Its servers hold the optimizer state outside the workers, so its memory is not modelled
before launch and the planner never proposes it; its workers never wait on each other
(``independent_workers``), so the trainer gathers nothing over the default group.
"""

from __future__ import annotations

from typing import Any, ClassVar

from paratrain.parallel.description import Strategy
from paratrain.parallel.options import RunSpec
from paratrain.parallel.ps.backup import check_backup_workers
from paratrain.parallel.ps.batchnorm import check_batchnorm
from paratrain.parallel.ps.clipping import check_clipping
from paratrain.parallel.ps.engine import ParameterServerEngine
from paratrain.parallel.ps.options import OPTIONS
from paratrain.parallel.ps.shared_memory import resolve_transport
from paratrain.parallel.registry import register


@register("ps")
class ParameterServerStrategy(Strategy):
    """Workers compute, servers own parameters and optimizer state (see
    ``ParameterServerEngine`` for the options)."""

    engine = ParameterServerEngine
    options = OPTIONS
    independent_workers: ClassVar[bool] = True
    """No worker ever waits on another, so callers must not gather over the default group."""

    @classmethod
    def check_run(cls, run: RunSpec) -> None:
        """Where the run starts, the straggler, backup workers and transport, then the batch."""
        if run.external_job:
            raise ValueError(
                "strategy 'ps' is not supported under torchrun/Slurm (it starts its own server "
                "processes and needs paratrain's launcher to outlive a lost worker); run "
                "`paratrain train` directly, or use --strategy dp."
            )
        straggler = run.options.get("straggler")
        if straggler is not None and straggler["rank"] >= run.devices:
            raise ValueError(
                f"--straggler names worker {straggler['rank']}, but the run has {run.devices} "
                f"worker(s) (0..{run.devices - 1})."
            )
        check_backup_workers(
            run.options.get("backup_workers", 0), run.options.get("staleness", 0), run.devices
        )
        resolve_transport(run.options.get("transport", "auto"))
        check_clipping(run.max_grad_norm, run.options.get("backup_workers", 0))
        if run.build_model is not None:
            check_batchnorm(run.build_model(), run.devices)
        super().check_run(run)

    @classmethod
    def launch_options(cls, run: RunSpec) -> dict[str, Any]:
        return {"timeout_s": run.timeout_s}

    @classmethod
    def parameter_share(cls, workers: int, options: dict[str, Any]) -> float | None:
        """Not modelled before launch (its servers hold the optimizer state outside the
        workers); each worker's ledger measures what it holds once running."""
        return None

    @classmethod
    def model_state_per_worker(cls, parameters, workers, options, **bytes_per_parameter) -> None:
        """Not modelled (see ``parameter_share``); never suggested by out-of-memory advice."""
        return None

    @classmethod
    def summary_lines(cls, metrics: dict[str, Any]) -> list[str]:
        """Servers, each worker's pushes per second, the staleness histogram."""
        bound = "none (asynchronous)" if metrics["staleness"] is None else metrics["staleness"]
        rates = ", ".join(
            f"worker {w}: {r:.1f}" for w, r in sorted(metrics["pushes_per_s"].items())
        )
        histogram = ", ".join(
            f"{s}: {n}" for s, n in sorted(metrics["staleness_histogram"].items())
        )
        backup = metrics.get("backup_workers", 0)
        transport = metrics.get("transport", "gloo").replace("_", " ")
        if backup:
            bound = f"{bound} (synchronous) with {backup} backup worker(s): late pushes fold in"
        if metrics.get("staleness_lr") == "inverse" and (metrics["staleness"] != 0 or backup):
            bound = f"{bound}, lr / (staleness + 1) (mean factor {metrics['mean_lr_factor']:.2f})"
        if metrics.get("lookahead"):
            bound = f"{bound}, lookahead pulls"
        return [
            f"  servers           {metrics['servers']} ({transport}), staleness bound {bound}",
            f"  pushes/s          {rates}",
            f"  push staleness    {histogram} (applied pushes by versions behind)",
        ]
