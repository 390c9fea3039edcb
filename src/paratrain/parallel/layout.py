"""The parallel degrees of a run, in one checked object: replicas x stages x tensor.

Every other place that needs a degree (the planner's candidates and cost models, the
mesh's process groups, an engine's share of the batch, a checkpoint's layout record, the
run summary) reads it from a ``Layout``, which a strategy's description builds once from
its typed options and the device count (``Strategy.layout``). Degrees that do not multiply
to the device count are refused here, and only here, with a sentence that says what would
fit. The idea is torchtitan's ``ParallelDims``: one frozen dataclass, checked on creation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class LayoutError(ValueError):
    """Parallel degrees that do not fit the number of workers."""


def _at_least_one(**degrees: int) -> None:
    for name, degree in degrees.items():
        if degree < 1:
            raise LayoutError(f"{name} must be at least 1, not {degree}.")


@dataclass(frozen=True)
class Layout:
    """How a run's workers are arranged; ``devices`` is their product.

    ``virtual_stages`` (model chunks per pipeline stage, run by the interleaved 1F1B
    schedule) does not change the device count.
    """

    replicas: int = 1
    stages: int = 1
    tensor: int = 1
    virtual_stages: int = 1

    def __post_init__(self) -> None:
        _at_least_one(
            replicas=self.replicas,
            stages=self.stages,
            tensor=self.tensor,
            virtual_stages=self.virtual_stages,
        )

    @classmethod
    def over(cls, devices: int, *, stages: int = 1, tensor: int = 1) -> Layout:
        """The layout of ``devices`` workers with these model-parallel degrees (the rest
        are replicas), or a refusal saying which degrees would divide them."""
        _at_least_one(stages=stages, tensor=tensor)
        model_parallel = stages * tensor
        if devices % model_parallel:
            fits = [d for d in range(1, devices + 1) if devices % d == 0]
            if tensor == 1:
                raise LayoutError(
                    f"{stages} pipeline stages do not divide {devices} workers evenly; use a "
                    f"stage count among {fits} or a multiple of {stages} workers."
                )
            if stages == 1:
                raise LayoutError(
                    f"tensor={tensor} does not divide {devices} workers into equal tensor "
                    f"groups; choose tensor among {fits}, or run on a multiple of {tensor} "
                    "workers."
                )
            raise LayoutError(
                f"{stages} stages x tensor {tensor} = {model_parallel} workers per replica do "
                f"not divide {devices} workers; choose stages x tensor among {fits}, or run "
                f"on a multiple of {model_parallel} workers."
            )
        return cls(replicas=devices // model_parallel, stages=stages, tensor=tensor)

    @property
    def devices(self) -> int:
        """Workers the layout occupies."""
        return self.replicas * self.stages * self.tensor

    @property
    def model_parallel(self) -> int:
        """Workers one replica of the model is spread over (stages x tensor)."""
        return self.stages * self.tensor

    @property
    def dp_enabled(self) -> bool:
        """Whether several replicas split the batch (and average gradients)."""
        return self.replicas > 1

    @property
    def pp_enabled(self) -> bool:
        """Whether the model is cut into pipeline stages."""
        return self.stages > 1

    @property
    def tp_enabled(self) -> bool:
        """Whether layers are split over tensor groups."""
        return self.tensor > 1

    def as_tuple(self) -> tuple[int, int, int]:
        """(replicas, stages, tensor): the planner's table column."""
        return self.replicas, self.stages, self.tensor

    def record(self) -> dict[str, Any]:
        """The degrees as a JSON record (checkpoint manifests, metrics); a degree left at
        its neutral value is omitted only for ``virtual_stages``, so that records of runs
        without virtual stages read as they always did."""
        record = {"replicas": self.replicas, "stages": self.stages, "tensor": self.tensor}
        if self.virtual_stages > 1:
            record["virtual_stages"] = self.virtual_stages
        return record
