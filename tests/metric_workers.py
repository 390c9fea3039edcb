"""Worker functions for the accuracy tests (spawned workers import them by name)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import paratrain
from paratrain.data import GlobalBatchLoader
from paratrain.models.mlp import mlp
from paratrain.run.evaluation import evaluate
from paratrain.run.metrics import ClassificationSums

FEATURES, CLASSES = 12, 5


def classification_split(samples: int, seed: int = 3) -> TensorDataset:
    """A small split whose labels follow the inputs loosely, so that an untrained model's
    accuracy is neither 0 nor 1 and a miscount shows."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, FEATURES, generator=generator)
    targets = torch.randint(0, CLASSES, (samples,), generator=generator)
    return TensorDataset(inputs, targets)


def model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return mlp(in_features=FEATURES, hidden=16, depth=2, classes=CLASSES)


def plain_figures(samples: int, rows: int | None = None) -> dict[str, float]:
    """One process, no engine: the mean loss and accuracy over the split's first ``rows``
    (all of them by default)."""
    inputs, targets = (t[:rows] for t in classification_split(samples).tensors)
    with torch.no_grad():
        logits = model()(inputs)
    top_two = logits.topk(2, dim=-1).values
    return {
        "gap": float((top_two[:, 0] - top_two[:, 1]).min()),
        "loss": float(F.cross_entropy(logits.double(), targets)),
        "accuracy": float((logits.argmax(-1) == targets).double().mean()),
        "count": len(targets),
    }


def engine_figures(runs: list[tuple[str, dict]], samples: int, global_batch: int) -> list[dict]:
    """Each engine's whole-split evaluation, and the accuracy its tally counted in one
    training step on the split's first global batch (before that step's update)."""
    split = classification_split(samples)
    out = []
    for strategy, options in runs:
        engine = paratrain.setup(
            model(),
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
            loss_fn=F.cross_entropy,
            strategy=strategy,
            **options,
        )
        loader = GlobalBatchLoader(split, global_batch, shuffle=False)
        result = evaluate(engine, ClassificationSums(), loader, None)
        inputs, targets = split[:global_batch]
        with engine.tally(ClassificationSums()) as tally:
            engine.train_step(inputs, targets)
        train = engine.tally_totals(tally)
        out.append(
            {
                "loss": result.loss,
                "accuracy": result.accuracy,
                "count": result.count,
                "train_correct": train["correct"],
                "train_count": train["count"],
            }
        )
        engine.close()
    return out
