"""zero3's units sized for the planner, from the measured model's module listing.

The engine picks its units on the model itself (``units.unit_modules``); the planner has
only what it measured (``ModelCosts.modules``: each module's path, class, the trainable
bytes it holds itself, whether it has a forward), so the same rules are applied to that
listing: the given entries by class name or by name pattern (outermost matches), or by
default a layer list's layers, else a model's repeated blocks (a class occurring twice or
more among the children of one ``ModuleList``/``Sequential``), else its top-level
children; a module with no forward of its own (a ``ModuleList``, which fires no hooks) is
replaced by its children. What no unit holds is the root, gathered through the whole
forward and backward. Two units sharing a parameter (tied weights), which the engine
joins into one, are sized apart here: the shared parameter counts once, at its first
holder.
"""

from __future__ import annotations

from collections import Counter
from fnmatch import fnmatchcase
from typing import Any

from paratrain.parallel.cost_model import ModelCosts

CONTAINERS = ("ModuleList", "Sequential")


def _inside(path: str, outer: str) -> bool:
    return outer == "" or path == outer or path.startswith(outer + ".")


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def _outermost(paths: list[str]) -> list[str]:
    return [p for p in paths if not any(o != p and _inside(p, o) for o in paths)]


def unit_paths(costs: ModelCosts, units: Any) -> list[str]:
    """The module paths of the units, in module order (see the module docstring)."""
    return _called(costs, _chosen(costs, units))


def _called(costs: ModelCosts, paths: list[str]) -> list[str]:
    """Each path, or where its module has no forward, its trainable children's (``units``
    does the same)."""
    called = {path: has_forward for path, _, _, has_forward in costs.modules}
    out = []
    for path in paths:
        if called.get(path, True):
            out.append(path)
        else:
            children = [
                p
                for p, *_ in costs.modules
                if p != path and _parent(p) == path and _held(costs, p) > 0
            ]
            out += _called(costs, children)
    return out


def _chosen(costs: ModelCosts, units: Any) -> list[str]:
    listing = [(path, kind) for path, kind, *_ in costs.modules if path]
    held = {path: _held(costs, path) for path, _ in listing}
    trainable = [(path, kind) for path, kind in listing if held[path] > 0]
    if units is not None:
        entries = [part.strip() for part in units.split(",")] if isinstance(units, str) else units
        kinds = {kind for _, kind in listing}
        found = []
        for entry in entries:
            name = entry if isinstance(entry, str) else entry.__name__
            found += [
                p for p, k in trainable if (k == name if name in kinds else fnmatchcase(p, name))
            ]
        return _outermost(sorted(set(found), key=[p for p, _ in listing].index))
    top = [p for p, _ in trainable if "." not in p]
    if costs.layer_list:
        return top
    blocks = []
    for container, kind in [("", costs.modules[0][1]), *listing]:
        if kind not in CONTAINERS:
            continue
        children = [(p, k) for p, k in trainable if p != container and _parent(p) == container]
        counts = Counter(k for _, k in children)
        blocks += [p for p, k in children if counts[k] > 1]
    return _outermost(blocks) or top


def _held(costs: ModelCosts, outer: str) -> int:
    return sum(own for path, _, own, _ in costs.modules if _inside(path, outer))


def units_by_layer(costs: ModelCosts, units: Any) -> tuple[list[list[float]], float]:
    """Per layer of ``costs``, its units' trainable bytes in module order (a unit goes to
    the layer that holds it, or the first layer it holds; a model that is no layer list is
    one layer), and the root's bytes."""
    if not costs.modules:
        raise ValueError(
            "these costs carry no module listing to size zero3's units from; measure the "
            "model again (paratrain plan --refresh, or refresh=True)."
        )
    names = [layer.name for layer in costs.layers]
    by_layer: list[list[float]] = [[] for _ in names]
    placed = 0.0
    for path in unit_paths(costs, units):
        index = 0
        if costs.layer_list:
            index = next(
                (i for i, n in enumerate(names) if _inside(path, n) or _inside(n, path)), 0
            )
        size = float(_held(costs, path))
        by_layer[index].append(size)
        placed += size
    return by_layer, max(0.0, costs.param_bytes() - placed)
