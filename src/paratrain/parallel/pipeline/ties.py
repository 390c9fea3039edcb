"""Weights tied across pipeline stages, kept one weight as on a single device.

A language model's output head usually shares the input embedding's Parameter; a pipeline
puts the embedding on the first stage and the head on the last, so each of those stages
holds its own copy. On one device the shared Parameter's gradient is the sum of what both
uses contribute; here each copy sees only its own stage's share. As Megatron-LM does with
its embedding group, the stages holding copies of a tied Parameter form a process group
(one per replica): the copies start equal (the first of those stages broadcasts its
values), and every step their gradients are summed over that group, after the gradient
reduction across replicas and before the optimizer step. With equal values, equal
gradients and the same optimizer, every copy then takes the same step and keeps the same
optimizer state, so the copies stay bit-for-bit equal. Checkpoints store the tensor once,
under its canonical name, written by the stage that holds that name (``ties``).

A tie between layers of one stage needs none of this: that stage holds one Parameter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from paratrain.runtime import comm
from paratrain.runtime.mesh import Mesh


def release_shared(layer: nn.Module, kept: set[int]) -> None:
    """Give ``layer`` (about to go to the meta device) placeholders for the Parameters it
    shares with this stage's layers (ids in ``kept``), so that moving it cannot move them
    (``Module.to`` may convert a Parameter in place, e.g. under torch's swap-tensors mode).
    """
    for module in layer.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and id(param) in kept:
                placeholder = torch.empty_like(param, device="meta")
                module._parameters[name] = nn.Parameter(placeholder, param.requires_grad)


def _stage_of(bounds: list[tuple[int, int]], index: int) -> int:
    return next(s for s, (start, end) in enumerate(bounds) if start <= index < end)


def layer_list_stages(
    layers: nn.Sequential, bounds: list[tuple[int, int]], prefix: str, *, stages: int = 0
) -> list[tuple[str, nn.Parameter, int]]:
    """(full-model name, Parameter, stage) of every parameter name of a cut layer list.

    ``bounds`` has one range per virtual stage; piece ``j`` lives on stage ``j % stages``
    (``stages``: the pipeline's, by default one per piece)."""
    stages = stages or len(bounds)
    return [
        (f"{prefix}{index}.{name}", param, _stage_of(bounds, index) % stages)
        for index, layer in enumerate(layers)
        for name, param in layer.named_parameters(remove_duplicate=False)
    ]


class CrossStageTies:
    """The tied Parameters that span stages, and this stage's share of them.

    Built from every (full-model name, Parameter, stage) before other stages' modules leave
    this worker; every rank must build it (creating process groups is collective).
    """

    def __init__(self, named: list[tuple[str, nn.Parameter, int]], mesh: Mesh) -> None:
        stages_of: dict[int, set[int]] = {}
        names: dict[int, list[str]] = {}
        for name, param, stage in named:
            stages_of.setdefault(id(param), set()).add(stage)
            names.setdefault(id(param), []).append(name)
        # stage set -> full-model names (one per tied Parameter) held by this stage
        spans: dict[tuple[int, ...], list[str]] = {}
        for key, stages in stages_of.items():
            if len(stages) > 1:
                spans.setdefault(tuple(sorted(stages)), []).append(names[key][0])
        self._names = {key: names[key] for key, stages in stages_of.items() if len(stages) > 1}
        self.groups: list[tuple[dist.ProcessGroup, list[str]]] = []
        """(group of this replica's stages holding the tie, their canonical names)."""
        for stages, canonical in spans.items():  # the same order on every rank
            for replica in range(mesh.replicas):
                for t in range(mesh.tensor):  # a copy whole, or rank t's vocab rows on each
                    members = [mesh.rank_of(stage, replica, t) for stage in stages]
                    group = dist.new_group(members)
                    here = (replica, t) == (mesh.replica, mesh.tensor_rank)
                    if here and mesh.stage in stages:
                        self.groups.append((group, canonical))
        self.params: list[list[nn.Parameter]] = []

    def attach(self, local: dict[str, nn.Parameter]) -> None:
        """Find this stage's copies among its parameters, keyed by full-model name (after
        the other stages' modules went to meta)."""
        by_canonical = {names[0]: names for names in self._names.values()}
        self.params = []
        for _, canonical in self.groups:
            params = []
            for name in canonical:
                params.append(next(local[n] for n in by_canonical[name] if n in local))
            self.params.append(params)

    def __bool__(self) -> bool:
        return bool(self.groups)

    @property
    def spans_stages(self) -> bool:
        """Whether any Parameter of the model is tied across stages (the same on every
        worker, where ``bool`` says whether this stage holds one)."""
        return bool(self._names)

    def broadcast_values(self) -> None:
        """Make every copy equal to the first stage's (the lowest rank of each group)."""
        for (group, _), params in zip(self.groups, self.params, strict=True):
            comm.broadcast_tensors(params, src=0, group=group)

    def reduce_gradients(self) -> None:
        """Sum each tied Parameter's gradient over the stages that hold a copy."""
        for (group, _), all_params in zip(self.groups, self.params, strict=True):
            params = [p for p in all_params if p.requires_grad]
            if not params:
                continue
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            comm.all_reduce_sum(flat, group=group)
            offset = 0
            for param, grad in zip(params, grads, strict=True):
                n = grad.numel()
                summed = flat[offset : offset + n].view_as(grad)
                if param.grad is None:
                    param.grad = summed.clone()
                else:
                    param.grad.copy_(summed)
                offset += n
