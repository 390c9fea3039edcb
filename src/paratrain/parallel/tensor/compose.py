"""What every strategy that splits layers over a tensor group declares and reports alike.

dp (and ``tp``, dp whose tensor degree defaults to every worker), zero1/2 and the pipeline
take the ``tensor`` option and the ``tp_plan`` keyword. ``SplitsLayersStrategy`` gives
their descriptions one answer each to the questions asked before any worker starts (the
tensor degree, the plan checked on a meta-device model, the share of the parameters a
worker holds, the summary lines), and ``SplitsLayers`` their engines one way to report
the split after the run, so no strategy spells them out a second time.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from paratrain.parallel.options import RunSpec, given
from paratrain.parallel.tensor import mappings
from paratrain.parallel.tensor.options import PLAN_KEYWORD, TENSOR
from paratrain.parallel.tensor.plan import resolve_plan
from paratrain.parallel.tensor.split import TensorSplit
from paratrain.runtime.mesh import Mesh


class SplitsLayersStrategy:
    """Mixin for a strategy description taking ``tensor``: the degree its ``layout``
    uses, the plan check, the share and the summary lines."""

    tensor_by_default: ClassVar[bool] = False
    """Whether a run that leaves ``tensor`` out splits over every worker (``tp``)."""

    @classmethod
    def tensor_degree(cls, devices: int, options: dict[str, Any]) -> int:
        """The tensor degree a run of ``devices`` workers with ``options`` gets: the one
        place the ``tensor`` option's default is resolved."""
        tensor = given(options, TENSOR)
        if tensor is None:
            return devices if cls.tensor_by_default else 1
        if cls.tensor_by_default and tensor == 1 < devices:
            raise ValueError(
                f"tensor=1 splits no layer over {devices} workers; choose strategy 'dp' for "
                "replicas alone, or a tensor of 2 or more."
            )
        return tensor

    @classmethod
    def check_tensor_plan(cls, run: RunSpec, tensor: int) -> None:
        """Refuse, before any worker starts, a model whose layers the plan cannot split."""
        if tensor > 1 and run.build_model is not None:
            resolve_plan(run.build_model(), tensor, run.options.get(PLAN_KEYWORD))

    @classmethod
    def split_summary_lines(cls, metrics: dict[str, Any]) -> list[str]:
        """The mesh and the parameters per worker, where the run split its layers."""
        if "mesh" not in metrics:
            return []
        lines = [f"  mesh              {metrics['mesh']}"]
        if metrics["tensor"] > 1:
            lines[0] += f" ({metrics['plan']})"
            lines.append(
                f"  parameters/worker {metrics['parameters_per_worker']:,} of "
                f"{metrics['parameters']:,} (split layers 1/{metrics['tensor']} each)"
            )
        return lines


class SplitsLayers:
    """Mixin for an Engine taking ``tensor``; the engine sets ``tensor_split`` (None where
    its degree is 1) and ``mesh`` once it has split its model."""

    tensor_split: TensorSplit | None = None
    mesh: Mesh | None = None

    def split_metrics(self, held: list[nn.Parameter], parameters: int) -> dict[str, Any]:
        """The figures ``split_summary_lines`` prints, for the run metrics (``held``: this
        worker's parameters; ``parameters``: the whole model's)."""
        if self.mesh is None:
            return {}
        split = self.tensor_split
        metrics: dict[str, Any] = {"mesh": self.mesh.describe(), "tensor": self.mesh.tensor}
        if split is not None:
            metrics.update(
                parameters=parameters,
                parameters_per_worker=sum(p.numel() for p in held),
                plan=split.describe(),
                tensor_all_reduces=dict(mappings.CALLS),
            )
        return metrics
