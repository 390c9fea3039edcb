"""What the descriptions of the replica strategies (dp, tp, zero1-3) answer alike.

Their workers form ``replicas x tensor`` (no stages): the tensor degree comes from the
``tensor`` option (``SplitsLayersStrategy``), the rest are replicas splitting the batch.
Before any worker starts they refuse the same things (degrees, batch, the tensor plan on a
meta-device model), hold the same share of a split model, and print the same summary.
"""

from __future__ import annotations

from typing import Any

from paratrain.parallel.description import Strategy
from paratrain.parallel.layout import Layout
from paratrain.parallel.options import RunSpec
from paratrain.parallel.tensor.compose import SplitsLayersStrategy


class ReplicaStrategy(SplitsLayersStrategy, Strategy):
    """A description whose engine is a ``ReplicaShare``: replicas, possibly tensor groups."""

    @classmethod
    def layout(cls, devices: int, options: dict[str, Any]) -> Layout:
        return Layout.over(devices, tensor=cls.tensor_degree(devices, options))

    @classmethod
    def check_run(cls, run: RunSpec) -> None:
        """The mesh and batch, then the tensor plan on a meta-device copy of the model."""
        super().check_run(run)
        cls.check_tensor_plan(run, cls.layout(run.devices, run.options).tensor)

    @classmethod
    def parameter_share(cls, workers: int, options: dict[str, Any]) -> float:
        """1/tensor: the share of a split layer a worker holds (a lower bound for the
        whole model, whose replicated tensors every member holds whole)."""
        return 1.0 / cls.layout(workers, options).tensor

    @classmethod
    def summary_lines(cls, metrics: dict[str, Any]) -> list[str]:
        return cls.split_summary_lines(metrics)
