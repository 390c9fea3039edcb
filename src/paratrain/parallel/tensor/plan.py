"""The tensor-parallel plan: which modules split how, found or given, checked before use.

``tp_plan`` maps ``fnmatch`` patterns over module names (``model.named_modules()``) to
``"colwise"``, ``"rowwise"``, ``"vocab"`` or ``"replicate"``; a module takes the first
pattern that matches it. Without one, the plan is found where it is unambiguous: two
``nn.Linear`` children of one module, the first feeding the second through elementwise
ops only (``detect``), become colwise then rowwise; the reference gpt's attention splits
by heads. Everything else is replicated.

Every split is checked here, on a meta-device model in the parent process as on the real
one in the workers, and refused with one sentence naming the module: no split found, a
pattern naming no module, a module of the wrong type, a colwise layer without the rowwise
layer that takes its slice (or joined to it by more than elementwise ops, where the
parent's forward traces), a width or head count that ``tensor`` does not divide, a tied
parameter. Pairs live in one parent module: an ``up`` in one module and its ``down`` in
another are not paired.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from torch import nn

from paratrain.parallel.tensor.attention import is_reference_attention
from paratrain.parallel.tensor.detect import elementwise_pairs

COLWISE, ROWWISE, VOCAB, REPLICATE = "colwise", "rowwise", "vocab", "replicate"
KINDS = (COLWISE, ROWWISE, VOCAB, REPLICATE)
EXAMPLE = "tp_plan={'*.up': 'colwise', '*.down': 'rowwise'}"


@dataclass(frozen=True)
class TensorPlan:
    """Module name -> "colwise" / "rowwise" / "vocab", and the attentions split by heads."""

    splits: dict[str, str] = field(default_factory=dict)
    attention: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line for logs: how many layers of each kind."""
        counts = {kind: list(self.splits.values()).count(kind) for kind in (COLWISE, ROWWISE)}
        parts = [f"{n} {kind}" for kind, n in counts.items() if n]
        parts += [f"{n} vocab" for n in [list(self.splits.values()).count(VOCAB)] if n]
        parts += [f"{len(self.attention)} attention by heads"] if self.attention else []
        return ", ".join(parts)

    def restricted_to(self, prefixes: set[str]) -> TensorPlan:
        """The part of the plan inside the modules ``prefixes`` names (a pipeline stage's):
        the whole plan is checked first, so that the stages agree on it."""

        def kept(name: str) -> bool:
            return any(name == p or name.startswith(p + ".") for p in prefixes)

        return TensorPlan(
            {name: kind for name, kind in self.splits.items() if kept(name)},
            tuple(name for name in self.attention if kept(name)),
        )


def _parent(name: str) -> tuple[str, str]:
    parent, _, child = name.rpartition(".")
    return parent, child


def _join(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child


def detect_plan(model: nn.Module) -> TensorPlan:
    """The plan found without ``tp_plan`` (see the module docstring)."""
    splits: dict[str, str] = {}
    attention: list[str] = []
    for name, module in model.named_modules():
        if is_reference_attention(module):
            attention.append(name)
            continue
        linears = [child for child in module.children() if isinstance(child, nn.Linear)]
        if len(linears) < 2:
            continue
        for first, second in elementwise_pairs(module) or []:
            splits[_join(name, first)] = COLWISE
            splits[_join(name, second)] = ROWWISE
    return TensorPlan(splits, tuple(attention))


def plan_from_patterns(model: nn.Module, tp_plan: dict[str, str]) -> TensorPlan:
    """The plan ``tp_plan`` gives, its kinds checked against the modules it names."""
    if not isinstance(tp_plan, dict):
        raise TypeError(f"tp_plan must be a dict of pattern -> kind, such as {EXAMPLE}.")
    for pattern, kind in tp_plan.items():
        if kind not in KINDS:
            raise ValueError(
                f"tp_plan gives {pattern!r} the kind {kind!r}; use one of {', '.join(KINDS)}."
            )
    modules = dict(model.named_modules())
    chosen: dict[str, str] = {}
    matched: set[str] = set()
    for name in modules:
        for pattern, kind in tp_plan.items():
            if name and fnmatch.fnmatchcase(name, pattern):
                matched.add(pattern)
                chosen[name] = kind
                break
    for pattern in tp_plan:
        if pattern not in matched:
            names = [n for n, m in modules.items() if isinstance(m, (nn.Linear, nn.Embedding))]
            raise ValueError(
                f"tp_plan pattern {pattern!r} names no module of {type(model).__name__}; its "
                f"Linear and Embedding modules are named like {', '.join(names[:4]) or 'none'}."
            )
    splits: dict[str, str] = {}
    attention: list[str] = []
    for name, kind in chosen.items():
        module = modules[name]
        wanted = nn.Embedding if kind == VOCAB else nn.Linear
        if kind != REPLICATE and not isinstance(module, wanted):
            raise ValueError(
                f"tp_plan makes {name!r} {kind}, but it is a {type(module).__name__}: colwise "
                "and rowwise split an nn.Linear, vocab an nn.Embedding."
            )
        parent, child = _parent(name)
        if kind in (COLWISE, ROWWISE) and is_reference_attention(modules[parent]):
            expected = COLWISE if child == "qkv" else ROWWISE
            partner = _join(parent, "proj" if child == "qkv" else "qkv")
            if kind != expected or chosen.get(partner) != (ROWWISE if kind == COLWISE else COLWISE):
                raise ValueError(
                    f"{parent!r} is gpt attention: split it by heads with {partner!r} and "
                    f"{name!r} as qkv colwise and proj rowwise, or replicate both."
                )
            if parent not in attention:
                attention.append(parent)
        elif kind != REPLICATE:
            splits[name] = kind
    return TensorPlan(splits, tuple(attention))


def _check_pairs(model: nn.Module, plan: TensorPlan) -> None:
    """Every colwise layer has, in its parent, the rowwise layer that takes its slice."""
    modules = dict(model.named_modules())
    traced: dict[str, list[tuple[str, str]] | None] = {}
    rowwise = {name for name, kind in plan.splits.items() if kind == ROWWISE}
    for name, kind in plan.splits.items():
        if kind != COLWISE:
            continue
        parent, child = _parent(name)
        if parent not in traced:
            traced[parent] = elementwise_pairs(modules[parent])
        width = modules[name].out_features
        partners = [
            row
            for row in sorted(rowwise)
            if _parent(row)[0] == parent and modules[row].in_features == width
        ]
        pairs = traced[parent]
        if pairs is not None:
            partners = [row for row in partners if (child, _parent(row)[1]) in pairs]
        if not partners:
            how = "joined to it by elementwise ops only " if pairs is not None else ""
            raise ValueError(
                f"tp_plan makes {name!r} colwise, but no rowwise Linear in "
                f"{parent or 'the model'!r} {how}takes its {width} output features; make the "
                f"Linear that consumes them rowwise, or make {name!r} replicate."
            )
        rowwise.discard(partners[0])
    for name in sorted(rowwise):
        raise ValueError(
            f"tp_plan makes {name!r} rowwise, but no colwise Linear beside it produces its "
            f"input slice; make the Linear that feeds it colwise, or make {name!r} replicate."
        )


def _check_divisible(model: nn.Module, plan: TensorPlan, tensor: int) -> None:
    modules = dict(model.named_modules())
    for name, kind in plan.splits.items():
        module = modules[name]
        what, size = {
            COLWISE: ("output features", getattr(module, "out_features", 0)),
            ROWWISE: ("input features", getattr(module, "in_features", 0)),
            VOCAB: ("rows", getattr(module, "num_embeddings", 0)),
        }[kind]
        if size % tensor:
            raise ValueError(
                f"{name!r} ({kind}) has {size} {what}, which tensor={tensor} does not divide; "
                f"choose a tensor that divides {size}, or make {name!r} replicate in tp_plan."
            )
    for name in plan.attention:
        heads = modules[name].n_head
        if heads % tensor:
            raise ValueError(
                f"attention {name!r} has {heads} heads, which tensor={tensor} does not divide; "
                f"choose a tensor that divides {heads}."
            )


def _check_untied(model: nn.Module, plan: TensorPlan) -> None:
    """A tied parameter is one tensor under two names: splitting one of them is refused."""
    seen: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        seen[id(param)] = seen.get(id(param), 0) + 1
    split = [*plan.splits, *plan.attention]
    modules = dict(model.named_modules())
    for name in split:
        for pname, param in modules[name].named_parameters():
            if seen[id(param)] > 1:
                raise ValueError(
                    f"{_join(name, pname)!r} is tied to another parameter, so it cannot be "
                    f"split; untie it, or make {name!r} replicate in tp_plan."
                )


def resolve_plan(model: nn.Module, tensor: int, tp_plan: dict[str, str] | None) -> TensorPlan:
    """The checked plan for ``model`` split over ``tensor`` ranks (see the docstring)."""
    plan = detect_plan(model) if tp_plan is None else plan_from_patterns(model, tp_plan)
    if not plan.splits and not plan.attention:
        where = "found no layer to split" if tp_plan is None else "splits no layer"
        raise ValueError(
            f"tensor parallel {where} in {type(model).__name__} (it needs two nn.Linear in "
            f"one module joined by elementwise ops, or gpt attention); name them with "
            f"{EXAMPLE}, or use strategy 'dp'."
        )
    _check_pairs(model, plan)
    _check_divisible(model, plan, tensor)
    _check_untied(model, plan)
    return plan
