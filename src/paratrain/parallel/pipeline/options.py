"""The pipeline strategy's options, as the command line, run files and ``setup`` take them."""

from __future__ import annotations

from paratrain.parallel.grad_buckets import BUCKET_MB
from paratrain.parallel.options import StrategyOption
from paratrain.parallel.pipeline.partition import COST_CHOICES
from paratrain.parallel.pipeline.schedules import SCHEDULES
from paratrain.parallel.recompute import RECOMPUTE
from paratrain.parallel.tensor.options import TENSOR


def parse_balance(text: str | list[int]) -> list[int]:
    """``"2,3,3"`` (command line, run file) as the layer counts ``[2, 3, 3]``."""
    if isinstance(text, list):
        return text
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(
            f"balance must be comma-separated layer counts such as 2,3,3, not {text!r}."
        ) from None


def parse_split_points(text: str | list[str]) -> list[str]:
    """``"transformer.h.2,transformer.h.4"`` (command line, run file) as block names."""
    if isinstance(text, list):
        return [str(name) for name in text]
    names = [part.strip() for part in text.split(",")]
    if not all(names):
        raise ValueError(
            f"split_points must be comma-separated block names such as transformer.h.2, "
            f"not {text!r}."
        )
    return names


STAGES = StrategyOption("stages", int, 2, "pipeline stages", minimum=1)
MICRO_BATCHES = StrategyOption(
    "micro_batches", int, None, "micro-batches per step (default 2 x stages)", minimum=1
)
SCHEDULE = StrategyOption("schedule", str, "1f1b", "pipeline schedule", choices=tuple(SCHEDULES))
BALANCE = StrategyOption("balance", str, None, "layers per stage, e.g. 2,3,3", parse=parse_balance)
BALANCE_BY = StrategyOption(
    "balance_by", str, "params", "what stages balance by", choices=COST_CHOICES
)
SPLIT_POINTS = StrategyOption(
    "split_points",
    str,
    None,
    "blocks where stages start, e.g. transformer.h.2 (default: repeated blocks, balanced)",
    parse=parse_split_points,
)

VIRTUAL_STAGES = StrategyOption(
    "virtual_stages",
    int,
    1,
    "model chunks per stage (layers or named blocks); above 1 the 1f1b schedule runs interleaved",
    minimum=1,
)

OPTIONS = (
    STAGES,
    VIRTUAL_STAGES,
    MICRO_BATCHES,
    SCHEDULE,
    BALANCE,
    BALANCE_BY,
    SPLIT_POINTS,
    RECOMPUTE,
    BUCKET_MB,
    TENSOR,
)


def micro_batches_per_replica(stages: int, given: int | None) -> int:
    """Micro-batches per replica and step: as given, else 2 x stages (enough to keep every
    stage busy under 1F1B once the pipeline has filled)."""
    return given or 2 * stages
