"""zero3's units as the planner sizes them (``zero/unit_sizes``, from the measured module
listing) against the units the engine picks on the model itself (``zero/units``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paratrain.parallel.cost_model import LayerCost, Line, ModelCosts, OptimizerCost
from paratrain.parallel.layers import is_layer_list
from paratrain.parallel.zero.unit_sizes import unit_paths, units_by_layer
from paratrain.parallel.zero.units import ROOT, unit_layout, unit_modules
from paratrain.planner.measure import module_listing


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(8), nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Tower(nn.Module):
    """No layer list: an embedding, repeated blocks in a ModuleList, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(8, 16)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _costs(model: nn.Module) -> ModelCosts:
    """Costs carrying only what unit sizing reads: the layers' names and bytes and the
    module listing."""
    listed = is_layer_list(model)
    layers = model if listed else [model]
    names = [str(i) for i in range(len(layers))] if listed else [type(model).__name__]
    zero = Line(0.0, 0.0)
    return ModelCosts(
        layers=tuple(
            LayerCost(
                name=name,
                param_bytes=sum(p.numel() * 4 for p in layer.parameters()),
                all_param_elements=0,
                param_elements=0,
                param_tensors=0,
                frozen_bytes=0,
                frozen_params=0,
                saved=zero,
                input_saved=zero,
                input_bytes=zero,
                output_bytes=zero,
                time_s=zero,
                forward_s=zero,
            )
            for name, layer in zip(names, layers, strict=True)
        ),
        layer_list=listed,
        tensor=1,
        precision="fp32",
        parameters=sum(p.numel() for p in model.parameters()),
        optimizer=OptimizerCost(8.0, 4.0, 0.0),
        modules=module_listing(model),
    )


MODELS = {
    "layer list": lambda: nn.Sequential(nn.Linear(4, 8), Block(), Block(), nn.Linear(8, 2)),
    "tower": Tower,
}


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("units", [None, "Linear", ["Block"], "*"])
def test_the_planners_units_are_the_engines(kind, units):
    """Same units, same bytes, same root, for the default rule (a layer list's layers, a
    model's repeated blocks) and for units given by class or pattern."""
    torch.manual_seed(0)
    model = MODELS[kind]()
    costs = _costs(model)
    assert unit_paths(costs, units) == [label for label, _ in unit_modules(model, units)]
    by_layer, root = units_by_layer(costs, units)
    layout = dict(unit_layout(model, units))
    assert sorted(size for sizes in by_layer for size in sizes) == sorted(
        4.0 * n for label, n in layout.items() if label != ROOT
    )
    assert root == 4.0 * layout.get(ROOT, 0)
