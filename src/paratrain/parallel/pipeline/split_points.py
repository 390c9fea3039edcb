"""Where a model that is not a layer list is cut: split points named by module.

A split point names a block of the model's repeated blocks, the children of one
``ModuleList`` or ``nn.Sequential`` (``"transformer.h.2"`` for GPT-2, ``"model.layers.2"``
for Llama); a stage starts at that block's call. Stage ``s`` owns the blocks from its
split point up to the next, the first stage also every parameter registered before the
blocks (embeddings), the last stage every parameter registered after them (final norm,
head). Ownership is by name, so state keeps the model's own ``state_dict()`` names: a
pipeline checkpoint loads into the original class. Registration order stands in for call
order here; ``stage_run`` refuses, with a sentence, a model whose forward calls them in
another order.

Under a tensor degree each stage's tensor group splits the planned layers of the modules
that stage alone holds (``StagePlan.modules_of``); a colwise/rowwise pair whose parent a
split point cuts is refused (``refuse_splits_across_stages``).

Without split points the blocks are found (the container with the most parameters among
those with at least ``stages`` children) and cut where the exact balancer puts the
boundaries by parameter count, the embeddings counted with the first block and the head
with the last.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from paratrain.parallel.layer_profile import LayerProfile
from paratrain.parallel.layers import layer_list
from paratrain.parallel.pipeline.partition import PartitionError, partition, stage_bounds
from paratrain.parallel.tensor.plan import COLWISE, ROWWISE, TensorPlan


@dataclass(frozen=True)
class StagePlan:
    """The blocks' container, the block index each stage starts at, and who owns what."""

    container: str
    starts: list[int]
    """Index of the first block of each stage (the first stage starts at 0)."""
    blocks: int
    owner: dict[str, int]
    """Every state-dict name (tied aliases included) -> the stage that holds it."""

    @property
    def stages(self) -> int:
        return len(self.starts)

    @property
    def split_points(self) -> list[str]:
        return [f"{self.container}.{index}" for index in self.starts[1:]]

    def modules_of(self, stage: int) -> set[str]:
        """Names of the modules whose state ``stage`` alone holds: what its tensor group
        may split (a module with state on two stages is split on neither)."""
        held: dict[str, set[int]] = {}
        for name, owner in self.owner.items():
            parts = name.split(".")[:-1]
            for depth in range(1, len(parts) + 1):
                held.setdefault(".".join(parts[:depth]), set()).add(owner)
        return {name for name, stages in held.items() if stages == {stage}}

    @property
    def balance(self) -> list[int]:
        """Blocks per stage (for the timeline and ``layout``)."""
        ends = [*self.starts[1:], self.blocks]
        return [end - start for start, end in zip(self.starts, ends, strict=True)]


def block_containers(model: nn.Module) -> dict[str, nn.Module]:
    """Every ``ModuleList``/``nn.Sequential`` below the root with at least two children."""
    return {
        name: module
        for name, module in model.named_modules()
        if name and isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) >= 2
    }


def valid_split_points(model: nn.Module) -> list[str]:
    return [
        f"{name}.{index}" for name, c in block_containers(model).items() for index in range(len(c))
    ]


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _refuse_name(model: nn.Module, point: str) -> PartitionError:
    valid = valid_split_points(model)
    shown = ", ".join(valid) if valid else "none (the model has no ModuleList of blocks)"
    return PartitionError(
        f"split point {point!r} is not a block of {type(model).__name__}; a split point names "
        f"a child of a ModuleList or nn.Sequential, one of: {shown}."
    )


def _starts_from_names(
    model: nn.Module, split_points: list[str], stages: int, virtual_stages: int = 1
) -> tuple[str, list[int]]:
    if len(split_points) != stages - 1:
        what = f"{stages} stages"
        if virtual_stages > 1:
            what = f"{stages // virtual_stages} stages x {virtual_stages} virtual stages"
        raise PartitionError(
            f"{what} need {stages - 1} split points, not {len(split_points)}; "
            f"give {stages - 1} block names or leave split_points out to choose them."
        )
    containers = block_containers(model)
    parents, indices = set(), []
    for point in split_points:
        parent, _, index = point.rpartition(".")
        if parent not in containers or not index.isdigit() or int(index) >= len(containers[parent]):
            raise _refuse_name(model, point)
        parents.add(parent)
        indices.append(int(index))
    if len(parents) > 1:
        raise PartitionError(
            f"split points {split_points} lie in different containers ({sorted(parents)}); "
            "name blocks of one ModuleList."
        )
    starts = [0, *indices]
    if any(b <= a for a, b in zip(starts[1:], starts[2:], strict=False)):
        raise PartitionError(
            f"split points {split_points} must name blocks in increasing order, each once."
        )
    return parents.pop() if parents else "", starts


def blocks_container(model: nn.Module, stages: int = 2) -> str:
    """The container an automatic cut into ``stages`` pieces uses: the one with the most
    parameters among those with at least ``stages`` blocks (the first on a tie)."""
    candidates = {n: c for n, c in block_containers(model).items() if len(c) >= stages}
    if not candidates:
        raise PartitionError(
            f"{type(model).__name__} has no ModuleList or nn.Sequential of at least {stages} "
            "blocks to cut into stages; use fewer stages or pass split_points."
        )
    return max(candidates, key=lambda n: _param_count(candidates[n]))


def automatic_container(model: nn.Module) -> str | None:
    """The blocks an automatic cut uses (``blocks_container``), or None where the model
    has no container of blocks to cut at."""
    return blocks_container(model) if block_containers(model) else None


def block_count(model: nn.Module) -> int:
    """The most pieces an automatic cut can make of a model that is no layer list: the
    blocks of its largest container (1 where it has none: it runs whole)."""
    container = automatic_container(model)
    return 1 if container is None else len(model.get_submodule(container))


def piece_param_counts(model: nn.Module, container: str) -> list[int]:
    """Parameters per block of ``container`` as the automatic cut balances them: the
    parameters registered before the blocks counted with the first, those after with the
    last, a tied Parameter once (at its first holder)."""
    blocks = list(model.get_submodule(container))
    counts = [_param_count(block) for block in blocks]
    inside = sum(counts)
    outside = sum(p.numel() for p in model.parameters()) - inside  # ties counted once
    before, after = _outside_split(model, container)
    counts[0] += before if outside else 0
    counts[-1] += after if outside else 0
    return counts


def every_block(model: nn.Module, container: str) -> StagePlan:
    """The plan that cuts ``model`` before every block of ``container``: piece ``i`` is
    block ``i``, the first also holding what comes before the blocks, the last what comes
    after (what the planner measures a model cut at named blocks by)."""
    blocks = len(model.get_submodule(container))
    starts = list(range(blocks))
    return StagePlan(container, starts, blocks, _owners(model, container, starts))


def automatic_balance(counts: list[int], stages: int) -> list[int]:
    """Blocks per stage of the automatic cut: the exact balancer on each piece's parameter
    count (``piece_param_counts``), 4 bytes each."""
    profiles = [LayerProfile(param_count=c, param_bytes=4 * c) for c in counts]
    return partition("params", profiles, stages)


def _automatic_starts(model: nn.Module, stages: int) -> tuple[str, list[int]]:
    name = blocks_container(model, stages)
    bounds = stage_bounds(automatic_balance(piece_param_counts(model, name), stages))
    return name, [start for start, _ in bounds]


def _outside_split(model: nn.Module, container: str) -> tuple[int, int]:
    """Parameters registered before and after the container (by module order)."""
    before = after = 0
    seen_container, seen = False, set()
    for name, module in model.named_modules():
        if name == container:
            seen_container = True
        if name == container or name.startswith(container + "."):
            continue
        for param in module.parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                if seen_container:
                    after += param.numel()
                else:
                    before += param.numel()
    return before, after


def _owners(model: nn.Module, container: str, starts: list[int]) -> dict[str, int]:
    """Each state-dict name's stage: a block's by its index, the rest by where its module
    is registered relative to the blocks."""
    last = len(starts) - 1
    owner: dict[str, int] = {}
    seen_container = False
    for name, module in model.named_modules(remove_duplicate=False):
        if name == container:
            seen_container = True
        persistent = [b for b in module._buffers if b not in module._non_persistent_buffers_set]
        local = [n for n, p in module._parameters.items() if p is not None] + persistent
        if not local:
            continue
        if name.startswith(container + "."):
            index = int(name[len(container) + 1 :].split(".")[0])
            stage = max(s for s, start in enumerate(starts) if start <= index)
        elif name == container or container.startswith(name + ".") or not name:
            raise PartitionError(
                f"{type(model).__name__} holds {local[0]!r} on {name or 'the model itself'!r}, "
                f"which encloses the blocks {container!r}, so no stage can own it; move it "
                "into a submodule before or after the blocks."
            )
        else:
            stage = last if seen_container else 0
        for entry in local:
            owner[f"{name}.{entry}"] = stage
    return owner


def plan_stages(
    model: nn.Module, stages: int, split_points: list[str] | None, *, virtual_stages: int = 1
) -> StagePlan:
    """The stages of ``model`` cut at ``split_points`` (block names), or chosen. With
    virtual stages, ``stages`` counts the pieces (pipeline stages x ``virtual_stages``):
    piece ``j`` is chunk ``j // p`` of stage ``j % p`` (``chunks``)."""
    if stages == 1 and not split_points:
        names = [*model.state_dict(keep_vars=True)]
        return StagePlan("", [0], 0, dict.fromkeys(names, 0))
    if split_points is None:
        container, starts = _automatic_starts(model, stages)
    else:
        container, starts = _starts_from_names(model, list(split_points), stages, virtual_stages)
    blocks = len(dict(model.named_modules())[container]) if container else 0
    return StagePlan(container, starts, blocks, _owners(model, container, starts))


def refuse_for_split_points(*, balance: object, balance_by: str, recompute: bool) -> None:
    """The layer-list options that a model cut at split points does not take."""
    if balance is not None:
        raise PartitionError(
            "balance counts the layers of an nn.Sequential; for a model cut at named blocks "
            "pass split_points=[...] instead."
        )
    if balance_by != "params":
        raise PartitionError(
            f"balance_by={balance_by!r} measures the layers of an nn.Sequential; a model cut "
            "at named blocks is balanced by parameters, or pass split_points=[...]."
        )
    if recompute:
        raise PartitionError(
            "recompute=True needs the model as an nn.Sequential under the pipeline; drop it "
            "for a model cut at named blocks."
        )


def refuse_splits_across_stages(stages: StagePlan, plan: TensorPlan) -> None:
    """A colwise layer's slice must reach its rowwise partner on the same stage (what
    crosses a split point is taken as whole), so each pair's parent module, and each
    attention or vocab embedding split whole, must be one stage's alone."""
    if stages.stages == 1:
        return
    held = set().union(*(stages.modules_of(stage) for stage in range(stages.stages)))
    for name, kind in [*plan.splits.items(), *((a, "attention") for a in plan.attention)]:
        unit = name.rpartition(".")[0] if kind in (COLWISE, ROWWISE) else name
        if unit not in held:
            raise PartitionError(
                f"the tensor plan splits {name!r} ({kind}), but "
                f"{unit or 'the model'!r} holds state on more than one stage, so its slices "
                f"would cross split point(s) {stages.split_points}; choose split points "
                "between the blocks that hold the split layers, or replicate it in tp_plan."
            )


def layer_list_balance(model: nn.Module, split_points: list[str], stages: int) -> list[int]:
    """Split points of a layer list (``"3"``, or ``"layers.3"``) as its ``balance``."""
    layers, prefix = layer_list(model)
    valid = [f"{prefix}{index}" for index in range(1, len(layers))]
    if len(split_points) != stages - 1:
        raise PartitionError(
            f"{stages} stages need {stages - 1} split points, not {len(split_points)}; "
            f"give {stages - 1} layer names or leave split_points out to choose them."
        )
    for point in split_points:
        if point not in valid:
            raise PartitionError(
                f"split point {point!r} is not a layer where a stage can start; one of: "
                f"{', '.join(valid)}."
            )
    starts = [0, *(int(p[len(prefix) :]) for p in split_points), len(layers)]
    if any(b <= a for a, b in zip(starts, starts[1:], strict=False)):
        raise PartitionError(
            f"split points {split_points} must name layers in increasing order, each once."
        )
    return [b - a for a, b in zip(starts, starts[1:], strict=False)]
