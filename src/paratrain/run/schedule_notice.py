"""What a resume does to the learning-rate schedule, said at resume.

The schedule is a pure function of the step and the run's length (``lr_schedule.py``),
so a resume that changes the length (``--resume A --steps 60`` after a 30-step cosine
run) or the schedule itself re-draws the curve: a finished cosine run at lr 0 continues
at a rate well above 0. As in Lightning and DeepSpeed, extending a run is allowed and the
schedule follows the new length; what was missing was a word about it. This module
writes that word.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from paratrain.config import TrainConfig
from paratrain.run.length import DEFAULT_STEPS, RunLength
from paratrain.run.lr_schedule import lr_factor


def saved_length(saved: Mapping[str, Any], train_samples: int) -> int:
    """The number of steps the saved run was to take (``run_length`` on its config)."""
    if saved.get("epochs") is not None:
        return int(saved["epochs"]) * max(1, train_samples // int(saved["global_batch"]))
    return int(saved.get("steps") or DEFAULT_STEPS)


def schedule_change(
    saved: Mapping[str, Any] | None,
    step: int,
    config: TrainConfig,
    length: RunLength,
    train_samples: int,
) -> str | None:
    """One clause for the resume line where the schedule the resumed run follows differs
    from the saved run's at the next step; None where the rate goes on as it would have.

    ``saved`` is the checkpoint's config (None for a checkpoint saved without one: then
    there is no earlier schedule to compare with), ``step`` the step it was saved at.
    """
    if not saved or "lr_schedule" not in saved:
        return None
    old_total = saved_length(saved, train_samples)
    old_lr = float(saved.get("lr", config.lr))
    old_schedule, old_warmup = saved["lr_schedule"], int(saved.get("warmup_steps", 0))

    def old_rate(at: int) -> float:
        return old_lr * lr_factor(old_schedule, at, total_steps=old_total, warmup_steps=old_warmup)

    def new_rate(at: int) -> float:
        return config.lr * lr_factor(
            config.lr_schedule, at, total_steps=length.steps, warmup_steps=config.warmup_steps
        )

    if abs(new_rate(step + 1) - old_rate(step + 1)) <= 1e-12 * max(old_lr, config.lr):
        return None
    return (
        f"the lr schedule ({config.lr_schedule}, {length.steps} steps) differs from the "
        f"saved run's ({old_schedule}, {old_total} steps): the lr was {old_rate(step):.3g} "
        f"at step {step} and is {new_rate(step + 1):.3g} at step {step + 1}"
    )
