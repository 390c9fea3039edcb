"""How long a run is: ``--steps``, or ``--epochs`` made steps from the training split.

An epoch is one pass of the training loader, whose incomplete last global batch is
dropped (``GlobalBatchLoader``'s ``tail="drop"``), so it is ``train_samples //
global_batch`` optimizer steps, the same on every rank. Epoch boundaries are then fixed
step numbers, which is what lets a resumed run, a checkpoint and the progress bar all
name the epoch from the step alone. When to evaluate and over how many batches follows
from the same choice: a run by epochs evaluates the whole test split at each epoch's end,
as the classic tutorials print test accuracy after each epoch; a run by steps every
``DEFAULT_EVAL_EVERY`` steps over ``DEFAULT_EVAL_BATCHES`` batches, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.config import ConfigError, TrainConfig

DEFAULT_STEPS = 300
DEFAULT_EVAL_EVERY = 100
DEFAULT_EVAL_BATCHES = 4


@dataclass(frozen=True)
class RunLength:
    """The run's steps, and its epochs where it was given in epochs."""

    steps: int
    steps_per_epoch: int
    epochs: int | None = None

    def epoch_of(self, step: int) -> int:
        """The epoch (from 1) that step ``step`` (from 1) belongs to."""
        return (step - 1) // self.steps_per_epoch + 1

    def ends_epoch(self, step: int) -> bool:
        return step % self.steps_per_epoch == 0

    def where(self, step: int) -> str:
        """``epoch 2/4 · step 470`` in a run by epochs, ``step 470`` in one by steps."""
        if self.epochs is None:
            return f"step {step}"
        return f"epoch {self.epoch_of(step)}/{self.epochs} · step {step}"


def run_length(config: TrainConfig, train_samples: int) -> RunLength:
    """The run's length from ``config`` and the training split's size; a warmup longer
    than the run is refused (the rate would never reach ``--lr``)."""
    length = _length(config, train_samples)
    if config.warmup_steps > length.steps:
        raise ConfigError(
            f"--warmup-steps {config.warmup_steps} is longer than the run's {length.steps} "
            "steps, so the lr would never reach --lr; lower --warmup-steps or train longer."
        )
    return length


def _length(config: TrainConfig, train_samples: int) -> RunLength:
    per_epoch = train_samples // config.global_batch
    if config.epochs is None:
        return RunLength(config.steps or DEFAULT_STEPS, max(per_epoch, 1))
    if per_epoch < 1:
        raise ConfigError(
            f"the training split has {train_samples} samples, fewer than one global batch of "
            f"{config.global_batch}, so an epoch has no step; lower --global-batch."
        )
    return RunLength(config.epochs * per_epoch, per_epoch, config.epochs)


def evaluates_at(config: TrainConfig, length: RunLength, step: int) -> bool:
    """Whether the run evaluates after step ``step``: never with ``--eval-every 0``; in a
    run by epochs at each epoch's end (and every ``--eval-every`` steps where given); in a
    run by steps every ``--eval-every`` steps (default 100) and after the last step."""
    every = config.eval_every
    if every == 0:
        return False
    if length.epochs is not None:
        return length.ends_epoch(step) or (every is not None and step % every == 0)
    return step % (every or DEFAULT_EVAL_EVERY) == 0 or step == length.steps


def eval_batches(config: TrainConfig, length: RunLength) -> int | None:
    """Batches per evaluation; None: the whole test split (``--eval-batches all``, the
    default of a run by epochs)."""
    chosen = config.eval_batches
    if chosen is None:
        return None if length.epochs is not None else DEFAULT_EVAL_BATCHES
    return None if chosen == "all" else chosen
