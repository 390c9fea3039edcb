"""Which modules zero3 shards as units (each gathered in full only while it computes).

The default follows FSDP's transformer auto-wrap policy: a model's repeated blocks (a
module class that occurs at least twice among the children of one ``nn.ModuleList`` or
``nn.Sequential``: ``GPT2Block``, ``LlamaDecoderLayer``) are a unit each, and every
parameter outside them (embeddings, final norm, head) belongs to the root unit, gathered
when the model's forward starts and kept until its backward is over. A model that is itself
an ``nn.Sequential`` (paratrain's layer lists) is cut at its layers instead, as the pipeline
and recompute cut it, and so is a model with no repeated block: its top-level children.

``units=`` overrides the choice with module names as ``named_modules()`` gives them, fnmatch
patterns over those names (``"transformer.h.*"``; a pattern keeps its outermost matches, so
``"*"`` gives the top-level children) or a module class or class name (``"GPT2Block"``).

Shared parameters (tied weights): a Parameter is one tensor, so it lives in one unit, and
every module holding it must gather that unit before computing. Units holding a common
Parameter are joined into one (labelled ``"0+4"``), and a module outside every unit that
holds a unit's Parameter (the embedding when the tied head is a unit) joins that unit. When
that module encloses the unit (the model itself), the unit's parameters go to the root.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from fnmatch import fnmatchcase

from torch import nn

from paratrain.parallel.options import StrategyOption

UnitSpec = str | type | Sequence[str | type]
"""What ``units=`` takes: one entry or a list of them (names, patterns, classes)."""

ROOT = "<root>"


def parse_units(text: str | list) -> list:
    """``"transformer.h.*,lm_head"`` (command line, run file) as a list of entries."""
    if isinstance(text, str):
        return [part.strip() for part in text.split(",") if part.strip()]
    return list(text)


UNITS = StrategyOption(
    "units",
    str,
    None,
    "zero3 units: comma-separated module names, patterns (transformer.h.*) or a class name",
    parse=parse_units,
)
"""zero3's ``units``; by default the model's repeated blocks, or a layer list's layers."""


def unit_modules(model: nn.Module, units: UnitSpec | None = None) -> list[tuple[str, list]]:
    """The units as ``(label, modules)`` in module order; the root unit is not listed.

    Raises ``ValueError`` (one sentence) for a ``units`` entry that matches no module or
    only modules without trainable parameters, or for two entries that overlap.
    """
    chosen = default_units(model) if units is None else named_units(model, units)
    return _join_shared(model, chosen)


def unit_layout(model: nn.Module, units: UnitSpec | None = None) -> list[tuple[str, int]]:
    """``(label, trainable elements)`` of each unit, the root (``"<root>"``) last if any."""
    layout, held = [], set()
    for label, modules in unit_modules(model, units):
        params = {id(p): p for m in modules for p in m.parameters() if p.requires_grad}
        held.update(params)
        layout.append((label, sum(p.numel() for p in params.values())))
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in held]
    return layout + ([(ROOT, sum(p.numel() for p in rest))] if rest else [])


def default_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The repeated blocks, or the top-level children of a layer list or block-less model."""
    if not isinstance(model, nn.Sequential):
        blocks = repeated_blocks(model)
        if blocks:
            return blocks
    return _called([(name, child) for name, child in model.named_children() if _trainable(child)])


def repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Children of a ModuleList/Sequential whose class occurs there twice or more (outermost)."""
    found = []
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = [(name, c) for name, c in module.named_children() if _trainable(c)]
        counts = Counter(type(child) for _, child in children)
        found += [(_join(path, name), c) for name, c in children if counts[type(c)] > 1]
    return _called(_outermost(found))


def named_units(model: nn.Module, units: UnitSpec) -> list[tuple[str, nn.Module]]:
    """The modules ``units`` names, checked: each entry matches, no two entries overlap."""
    entries = [units] if isinstance(units, (str, type)) else list(units)
    if not entries:
        raise ValueError("units names no module; leave it out for the default units.")
    modules = [(path, m) for path, m in model.named_modules() if path]
    class_names = {type(m).__name__ for _, m in modules}
    chosen: dict[str, tuple[object, nn.Module]] = {}  # path -> (entry, module)
    for entry in entries:
        if isinstance(entry, type):
            matched = [(p, m) for p, m in modules if isinstance(m, entry)]
        elif isinstance(entry, str) and entry in class_names:
            matched = [(p, m) for p, m in modules if type(m).__name__ == entry]
        elif isinstance(entry, str):
            matched = [(p, m) for p, m in modules if fnmatchcase(p, entry)]
        else:
            raise ValueError(
                f"units takes module names, name patterns or module classes, not {entry!r}."
            )
        if not matched:
            examples = ", ".join(repr(p) for p, _ in (repeated_blocks(model) or modules)[:2])
            raise ValueError(
                f"units entry {_show(entry)} matches no module of {type(model).__name__}; give "
                f"names as named_modules() spells them (such as {examples}), fnmatch patterns "
                "over them or a module class."
            )
        matched = _outermost([(p, m) for p, m in matched if _trainable(m)])
        if not matched:
            raise ValueError(
                f"units entry {_show(entry)} matches only modules with no trainable parameters."
            )
        matched = _called(matched)
        if not matched:
            raise ValueError(
                f"units entry {_show(entry)} matches only containers that are never called "
                "(such as a ParameterList), so nothing would gather them; name the modules "
                "that use their parameters."
            )
        for path, module in matched:
            for other, (other_entry, _) in chosen.items():
                if _inside(path, other) or _inside(other, path):
                    inner, outer = (path, other) if _inside(path, other) else (other, path)
                    where = f"both take {inner}" if inner == outer else f"{inner} is in {outer}"
                    raise ValueError(
                        f"units entries {_show(other_entry)} and {_show(entry)} overlap "
                        f"({where}); a module belongs to one unit only."
                    )
            chosen[path] = (entry, module)
    order = {path: i for i, (path, _) in enumerate(modules)}
    return sorted(((p, m) for p, (_, m) in chosen.items()), key=lambda pm: order[pm[0]])


def _join_shared(
    model: nn.Module, chosen: list[tuple[str, nn.Module]]
) -> list[tuple[str, list[nn.Module]]]:
    """Group the chosen modules with whatever shares a parameter with them (see above).

    Atoms are the chosen modules (all their parameters) and each module outside them that
    registers trainable parameters itself; atoms sharing a Parameter are joined.
    """
    unit_of_path = {path: i for i, (path, _) in enumerate(chosen)}
    atoms: list[tuple[str, nn.Module, list]] = [
        (path, m, [p for p in m.parameters() if p.requires_grad]) for path, m in chosen
    ]
    order = {}
    for position, (path, module) in enumerate(model.named_modules(remove_duplicate=False)):
        order.setdefault(path, position)
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if own and _owner(path, unit_of_path) is None:
            atoms.append((path, module, own))
    parent = list(range(len(atoms)))

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    holder: dict[int, int] = {}
    for index, (_, _, params) in enumerate(atoms):
        for param in params:
            first = holder.setdefault(id(param), index)
            a, b = sorted((root(first), root(index)))
            parent[b] = a
    groups: dict[int, list[int]] = {}
    for index in range(len(atoms)):
        groups.setdefault(root(index), []).append(index)
    units = []
    for members in groups.values():
        if not any(i < len(chosen) for i in members):
            continue  # nothing chosen: these parameters stay in the root unit
        paths = sorted({atoms[i][0] for i in members}, key=order.__getitem__)
        if any(_inside(p, q) and p != q for p in paths for q in paths) or not all(
            _has_forward(atoms[i][1]) for i in members
        ):
            continue  # a holder encloses the unit or is never called: the root holds them
        modules = list({id(atoms[i][1]): atoms[i][1] for i in members}.values())
        modules = [m for m in modules if not any(m is not o and _contains(o, m) for o in modules)]
        units.append((order[paths[0]], "+".join(paths), modules))
    return [(label, modules) for _, label, modules in sorted(units, key=lambda u: u[0])]


def _called(found: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """A container that is never called (ModuleList, ModuleDict) fires no hooks, so it is
    replaced by its children; parameters it registers itself stay in the root."""
    out = []
    for path, module in found:
        if _has_forward(module):
            out.append((path, module))
        else:
            children = [(_join(path, n), c) for n, c in module.named_children() if _trainable(c)]
            out += _called(children)
    return out


def _has_forward(module: nn.Module) -> bool:
    return type(module).forward is not nn.Module.forward


def _trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _inside(path: str, outer: str) -> bool:
    """Whether the module at ``path`` is the one at ``outer`` or one of its descendants."""
    return outer == "" or path == outer or path.startswith(outer + ".")


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def _owner(path: str, unit_of_path: dict[str, int]) -> int | None:
    """The chosen module that is, or encloses, the module at ``path``."""
    parts = path.split(".") if path else []
    for end in range(1, len(parts) + 1):
        index = unit_of_path.get(".".join(parts[:end]))
        if index is not None:
            return index
    return None


def _outermost(found: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    paths = [path for path, _ in found]
    return [(p, m) for p, m in found if not any(_inside(p, q) and p != q for q in paths)]


def _show(entry: object) -> str:
    return entry.__name__ if isinstance(entry, type) else repr(entry)


def check_units(model: nn.Module, units: UnitSpec | None, recompute: bool) -> None:
    """Refuse ``units`` entries that name nothing, and ``recompute`` where zero3 cannot
    segment the model: asked before launch (on a meta copy) and again by the engine."""
    unit_modules(model, units)
    if recompute and not isinstance(model, nn.Sequential):
        raise ValueError(
            f"zero3 with recompute=True needs the model itself to be an nn.Sequential "
            f"(its layers are both the sharded units and the recomputed segments), not "
            f"{type(model).__name__}; pass the layer list as the model, or use "
            "recompute=False or strategy='zero2'."
        )
    if recompute and units is not None:
        raise ValueError(
            "zero3 with recompute=True shards the layers of the nn.Sequential as units "
            "(they are also the recomputed segments), so it takes no units option; drop "
            "units= or recompute=True."
        )
