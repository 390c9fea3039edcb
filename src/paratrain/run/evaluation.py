"""The trainer's evaluation pass and its running train accuracy, exact on any engine.

Both are read off a tally (``Engine.tally``) of sums: summed loss, correct predictions,
samples counted. Sums over the workers' parts add up to the whole's, so the figures are
exact global ones (not a mean of the workers' means), and an evaluation over the whole
test split stays exact when the split does not divide by the global batch or the
device count: the last batch is made whole with repeated rows whose targets are masked
(``IGNORE_INDEX``), which the metric leaves out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from paratrain.data import GlobalBatchLoader, batches, whole_split
from paratrain.parallel.metric_tally import IGNORE_INDEX, Tally
from paratrain.run.metrics import ClassificationSums, TokenSums


@dataclass(frozen=True)
class EvalResult:
    """One evaluation: the mean loss and accuracy over ``count`` samples (or tokens)."""

    loss: float
    accuracy: float | None
    count: int
    unit: str

    def line(self, where: str) -> str:
        """The console line: ``epoch 2/4 · step 470 · eval loss 0.4123 · accuracy 85.31%
        (10000 samples)``."""
        accuracy = "" if self.accuracy is None else f" · accuracy {100 * self.accuracy:.2f}%"
        return f"{where} · eval loss {self.loss:.4f}{accuracy} ({self.count} {self.unit})"

    def record(self) -> dict[str, Any]:
        """The fields of the metrics file's ``eval`` record."""
        extra = {} if self.accuracy is None else {"accuracy": self.accuracy}
        return {"eval_loss": self.loss, **extra, "samples": self.count}


def mask_padding(targets: torch.Tensor, real: int) -> torch.Tensor:
    """``targets`` with the rows from ``real`` on marked as padding."""
    if real >= targets.shape[0]:
        return targets
    masked = targets.clone()
    masked[real:] = IGNORE_INDEX
    return masked


def evaluate(
    engine,
    metric: ClassificationSums | TokenSums,
    loader: GlobalBatchLoader,
    count: int | None,
) -> EvalResult:
    """Evaluate ``count`` batches of ``loader`` (the next ones; it cycles), or with
    ``count=None`` its whole split once. Every worker calls it."""
    with engine.tally(metric) as tally:
        if count is None:
            for (inputs, targets), real in whole_split(loader.dataset, loader.global_batch):
                engine.eval_step(inputs, mask_padding(targets, real))
        else:
            for inputs, targets in batches(loader, count):
                engine.eval_step(inputs, targets)
    totals = engine.tally_totals(tally)
    counted = int(totals["count"])
    return EvalResult(
        loss=totals["loss_sum"] / counted,
        accuracy=totals["correct"] / counted if "correct" in totals else None,
        count=counted,
        unit="samples" if "correct" in totals else "tokens",
    )


def running_accuracy(engine, tally: Tally) -> float | None:
    """The accuracy of the training predictions since the last call (then starts afresh);
    None where the metric counts no correct answers or nothing was counted. Every worker
    calls it."""
    totals = engine.tally_totals(tally)
    tally.reset()
    if "correct" not in totals or not totals["count"]:
        return None
    return totals["correct"] / totals["count"]
