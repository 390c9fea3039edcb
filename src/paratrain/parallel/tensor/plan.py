"""The tensor-parallel plan: which modules split how, found or given, checked before use.

``tp_plan`` maps ``fnmatch`` patterns over module names (``model.named_modules()``) to
``"colwise"``, ``"rowwise"``, ``"vocab"`` (an embedding or an lm head, split by token id)
or ``"replicate"``; a module takes the first
pattern that matches it (``"auto"``, or Hugging Face's kinds: see ``hf_plan``). Without
one, the plan is found where it is unambiguous: the ``nn.Linear`` (or ``Conv1D``)
children of one module, one or two feeding another through elementwise ops only
(``detect``: an MLP, a gated MLP), become colwise then rowwise; an attention of a shape
``heads`` knows splits by heads (a plan must name all of its projections, or none).
Everything else is replicated.

Every split is checked here, on a meta-device model in the parent process as on the real
one in the workers, and refused with one sentence naming the module: no split found, a
pattern naming no module, a module of the wrong type, a colwise layer without the rowwise
layer that takes its slice (or joined to it by more than elementwise ops), a colwise
layer in a module whose forward does not trace (nothing could check it), a width or head
count that ``tensor`` does not divide, a tied parameter (but for one tied across "vocab"
modules: an embedding and its head cut alike). Pairs live in one parent module:
an ``up`` in one module and its ``down`` in another are not paired.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from torch import nn

from paratrain.parallel.tensor.detect import feeding_groups, in_width, is_linear, out_width
from paratrain.parallel.tensor.heads import attention_shape, check_heads
from paratrain.parallel.tensor.hf_plan import translated

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


def _vocab_module(module: nn.Module) -> bool:
    """What "vocab" splits by token id: an embedding's rows, an output layer's rows."""
    return isinstance(module, (nn.Embedding, nn.Linear))


def vocab_size(module: nn.Module) -> int:
    """The vocabulary a "vocab" module covers: its rows (embedding) or outputs (head)."""
    return module.num_embeddings if isinstance(module, nn.Embedding) else module.out_features


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
        if attention_shape(module) is not None:
            attention.append(name)
            continue
        if sum(is_linear(child) for child in module.children()) < 2:
            continue
        for colwise, rowwise in feeding_groups(module) or []:
            splits.update({_join(name, child): COLWISE for child in colwise})
            splits[_join(name, rowwise)] = ROWWISE
    return TensorPlan(splits, tuple(attention))


def _checked_kinds(tp_plan: dict[str, str]) -> None:
    if not isinstance(tp_plan, dict):
        raise TypeError(
            f"tp_plan must be a dict of pattern -> kind, such as {EXAMPLE}, or 'auto' (a "
            "Hugging Face model's own plan)."
        )
    for pattern, kind in tp_plan.items():
        if kind not in KINDS:
            raise ValueError(
                f"tp_plan gives {pattern!r} the kind {kind!r}; use one of {', '.join(KINDS)}."
            )


def _chosen(model: nn.Module, tp_plan: dict[str, str]) -> dict[str, str]:
    """Module name -> the kind of the first pattern that names it; every pattern used."""
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
            names = [n for n, m in modules.items() if is_linear(m) or isinstance(m, nn.Embedding)]
            raise ValueError(
                f"tp_plan pattern {pattern!r} names no module of {type(model).__name__}; its "
                f"Linear and Embedding modules are named like {', '.join(names[:4]) or 'none'}."
            )
    return chosen


def _whole_attention(name: str, module: nn.Module, chosen: dict[str, str]) -> bool:
    """Whether the plan splits the recognised attention ``name`` by heads: all of its
    projections as the shape wants (True), or none of them (False); else refused."""
    shape = attention_shape(module)
    wanted = {_join(name, child): COLWISE for child in shape.inputs}
    wanted[_join(name, shape.output)] = ROWWISE
    given = {child: chosen[child] for child in wanted if chosen.get(child, REPLICATE) != REPLICATE}
    if given and given != wanted:
        raise ValueError(
            f"{name!r} is a {type(module).__name__}, an attention that splits only by heads, its "
            f"projections together (a part alone would change what it computes); use "
            f"{shape.plan_text(name)}, or make them all replicate."
        )
    return bool(given)


def plan_from_patterns(model: nn.Module, tp_plan: dict[str, str]) -> TensorPlan:
    """The plan ``tp_plan`` gives, its kinds checked against the modules it names."""
    _checked_kinds(tp_plan)
    modules = dict(model.named_modules())
    chosen = _chosen(model, tp_plan)
    splits: dict[str, str] = {}
    attention: list[str] = []
    for name, kind in chosen.items():
        module = modules[name]
        wanted, what = (
            (_vocab_module, "an nn.Embedding or an output nn.Linear (the lm head)")
            if kind == VOCAB
            else (is_linear, "an nn.Linear (or GPT-2's Conv1D)")
        )
        if kind != REPLICATE and not wanted(module):
            raise ValueError(
                f"tp_plan makes {name!r} {kind}, but it is a {type(module).__name__}: {kind} "
                f"splits {what}; make {name!r} replicate, or name the layers inside it."
            )
        parent = _parent(name)[0]
        if kind in (COLWISE, ROWWISE) and attention_shape(modules[parent]) is not None:
            if parent not in attention and _whole_attention(parent, modules[parent], chosen):
                attention.append(parent)
        elif kind != REPLICATE:
            splits[name] = kind
    return TensorPlan(splits, tuple(attention))


def _refuse_untraced(name: str, parent: str, module: nn.Module) -> None:
    raise ValueError(
        f"tp_plan makes {name!r} colwise inside {parent or 'the model'!r} "
        f"({type(module).__name__}), whose forward torch.fx cannot trace, so nothing shows "
        f"that what joins it to a rowwise layer acts on each feature alone; make {name!r} "
        f"replicate, or split a module whose forward traces (an MLP, or an attention of a "
        f"shape paratrain knows: Hugging Face q/k/v/o_proj, GPT-2 c_attn, nanoGPT)."
    )


def _check_pairs(model: nn.Module, plan: TensorPlan) -> None:
    """Every colwise layer feeds, in its parent and through elementwise ops alone, the
    rowwise layer that takes its slice (with the other colwise layers of a gated MLP)."""
    modules = dict(model.named_modules())
    traced: dict[str, list | None] = {}
    rowwise = {name for name, kind in plan.splits.items() if kind == ROWWISE}
    for name, kind in plan.splits.items():
        if kind != COLWISE:
            continue
        parent, child = _parent(name)
        if parent not in traced:
            traced[parent] = feeding_groups(modules[parent])
        if traced[parent] is None:
            _refuse_untraced(name, parent, modules[parent])
        group = next((g for g in traced[parent] if child in g[0]), None)
        members = [] if group is None else [_join(parent, c) for c in group[0]]
        row = None if group is None else _join(parent, group[1])
        if (
            group is None
            or plan.splits.get(row) != ROWWISE
            or any(
                plan.splits.get(m) != COLWISE or out_width(modules[m]) != in_width(modules[row])
                for m in members
            )
        ):
            fix = (
                f"make {', '.join(map(repr, members))} colwise and {row!r} rowwise"
                if group
                else "make the Linear that consumes its output (through elementwise ops only) "
                "rowwise"
            )
            raise ValueError(
                f"tp_plan makes {name!r} colwise, but no rowwise Linear in "
                f"{parent or 'the model'!r} takes its {out_width(modules[name])} output "
                f"features, joined to it by elementwise ops only; {fix}, or make {name!r} "
                "replicate."
            )
        rowwise.discard(row)
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
            COLWISE: ("output features", out_width),
            ROWWISE: ("input features", in_width),
            VOCAB: ("token ids", vocab_size),
        }[kind]
        size = size(module)
        if size % tensor:
            divisors = [d for d in range(2, min(size, 64) + 1) if size % d == 0]
            which = ", ".join(map(str, divisors[:8])) if divisors else "none up to 64"
            raise ValueError(
                f"{name!r} ({kind}) has {size} {what}, which tensor={tensor} does not divide; "
                f"choose a tensor that divides {size} ({which}), pad the "
                f"{'vocabulary' if kind == VOCAB else 'width'} to a multiple of {tensor}, or "
                f"make {name!r} replicate in tp_plan."
            )
    for name in plan.attention:
        check_heads(name, attention_shape(modules[name]), tensor)


def _check_untied(model: nn.Module, plan: TensorPlan) -> None:
    """A tied parameter is one tensor under two names: splitting one of them is refused,
    unless every module holding it splits it by vocabulary (a tied embedding and lm head
    cut the same rows, so the slice stays one tensor)."""
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for pname, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append(_join(name, pname))
    split = [*plan.splits, *plan.attention]
    modules = dict(model.named_modules())
    for name in split:
        for pname, param in modules[name].named_parameters():
            holders = owners[id(param)]
            if len(holders) > 1 and not all(
                plan.splits.get(_parent(h)[0]) == VOCAB for h in holders
            ):
                raise ValueError(
                    f"{_join(name, pname)!r} is tied to {', '.join(map(repr, holders))}, so it "
                    f"cannot be split alone; make every module holding it 'vocab' (a tied "
                    f"embedding and lm head), untie it, or make {name!r} replicate in tp_plan."
                )


def resolve_plan(model: nn.Module, tensor: int, tp_plan: dict[str, str] | str | None) -> TensorPlan:
    """The checked plan for ``model`` split over ``tensor`` ranks (see the docstring)."""
    if tp_plan is not None:
        tp_plan = translated(model, tp_plan, tensor)
    plan = detect_plan(model) if tp_plan is None else plan_from_patterns(model, tp_plan)
    if not plan.splits and not plan.attention:
        where = "found no layer to split" if tp_plan is None else "splits no layer"
        raise ValueError(
            f"tensor parallel {where} in {type(model).__name__} (it needs two nn.Linear in "
            f"one module joined by elementwise ops, or an attention it knows); name them with "
            f"{EXAMPLE}, or use strategy 'dp'."
        )
    _check_pairs(model, plan)
    _check_divisible(model, plan, tensor)
    _check_untied(model, plan)
    return plan
