"""``paratrain train --strategy auto``: the planner chooses the strategy before any worker starts.

The parent builds the model once, measures it on a batch of the training data and asks
``paratrain.plan`` for the fastest layout predicted to fit ``--memory-per-device``; the
run then goes on as if its flags had named that strategy and its options. Options the
user did give (``--stages 4``, ``--precision bf16``, ``--gradient-accumulation 2``) are
kept: the planner searches only what was left open. The console says the choice and its
prediction before training, and the measured figures beside the prediction after.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from torch import nn

from paratrain.config import AUTO, TrainConfig, declared_option_names
from paratrain.planner import Plan, plan
from paratrain.runtime.units import format_bytes


def fixed_options(config: TrainConfig) -> dict[str, Any]:
    """The strategy options the user set (those not at their declared defaults)."""
    defaults = TrainConfig()
    return {
        name: getattr(config, name)
        for name in declared_option_names()
        if getattr(config, name) != getattr(defaults, name)
    }


def planned_config(
    config: TrainConfig,
    *,
    devices: int,
    model: nn.Module,
    optimizer: Callable,
    loss_fn: Callable,
    sample: tuple[Any, Any],
    refresh: bool = False,
) -> tuple[TrainConfig, Plan]:
    """``config`` with the strategy and options the planner chose, and the plan: among
    every strategy under ``auto``, else among the layouts of the one it names."""
    strategies = None if config.strategy == AUTO else (config.strategy,)
    fixed = fixed_options(config)
    accumulation = config.gradient_accumulation if config.gradient_accumulation != 1 else None
    chosen = plan(
        model,
        devices=devices,
        global_batch=config.global_batch,
        memory_per_device=config.memory_per_device,
        optimizer=optimizer,
        loss_fn=loss_fn,
        sample=sample,
        precision=config.precision,
        gradient_accumulation=accumulation,
        strategy=strategies,
        refresh=refresh,
        **fixed,
    )
    options = {key: value for key, value in chosen.options.items() if hasattr(config, key)}
    return replace(config, strategy=chosen.strategy, **options), chosen


def measured_lines(chosen: Plan, peak_bytes: list[int | None], samples_per_s: float) -> list[str]:
    """The summary's comparison of the plan's prediction with the run."""
    peaks = [p for p in peak_bytes if p]
    measured = max(peaks) if peaks else None
    predicted = chosen.predicted_peak_bytes
    lines = [f"  planned           {chosen.strategy} {_shown(chosen.options)}".rstrip()]
    error = f" ({measured / predicted - 1:+.1%} off)" if measured and predicted else ""
    lines.append(
        f"  planned memory    {format_bytes(predicted)} peak per worker predicted, "
        f"{format_bytes(measured) if measured else 'n/a'} measured by the ledger{error}"
    )
    predicted_rate = chosen.global_batch / chosen.predicted_step_s
    lines.append(
        f"  planned speed     {predicted_rate:,.1f} samples/s predicted, "
        f"{samples_per_s:,.1f} measured"
    )
    return lines


def _shown(options: dict[str, Any]) -> str:
    shown = {
        k: v
        for k, v in options.items()
        if (k, v) not in (("gradient_accumulation", 1), ("precision", "fp32"))
    }
    return "(" + ", ".join(f"{k}={v}" for k, v in shown.items()) + ")" if shown else ""
