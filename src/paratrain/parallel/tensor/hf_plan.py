"""Hugging Face's tensor-parallel plans read as ours.

A Hugging Face model carries two plans, which ``from_pretrained(tp_plan="auto")`` applies
together: its config's ``base_model_tp_plan``, patterns relative to the base model
(``layers.*.self_attn.q_proj``), and its class's ``_tp_plan``, patterns relative to the
model itself (``LlamaForCausalLM._tp_plan``: ``lm_head``). ``tp_plan="auto"`` takes both;
a plan passed as is may use those names too. Base-model patterns get the base model's
prefix (``model.``) where the pattern alone names nothing. Only kinds with an exact
counterpart here are taken (``EXACT``); the others (``local_*``, ``gather``,
``sequence_parallel``, ...) change where outputs are gathered or rely on DTensor's
layouts, and are refused with the plan that would work without them.

One more kind is taken from the class's plan: the lm head's ``colwise_rep`` (called
``colwise_gather_output`` since transformers 5), a head split by output columns whose
logits are gathered. Our ``vocab`` split is the same cut, and its logits are exact
either way: they stay split where the loss is paratrain's token cross-entropy
(``vocab_loss``) and are gathered for any other loss. Where ``vocab`` cannot cut that
head (not an ``nn.Linear``, a vocabulary the tensor degree does not divide, a weight tied
to a module the plan does not also split by vocabulary) the head is replicated instead,
which is exact too; the line ``applied_line`` prints says which, and why.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from torch import nn

AUTO = "auto"
EXACT = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "replicate": "replicate",
    "vocab": "vocab",
    "embedding_rowwise": "vocab",
}
"""Hugging Face's kind -> ours, where both split the same tensors the same way."""
GATHERED_HEAD = ("colwise_rep", "colwise_gather_output")
"""The class plan's lm head kinds: columns split, logits gathered (see the docstring)."""


@dataclass(frozen=True)
class Entry:
    """One entry ``tp_plan="auto"`` applied: its pattern, our kind, where it came from
    (and, for a gathered head, why it became ``vocab`` or ``replicate``)."""

    pattern: str
    kind: str
    source: str


def _prefixed(model: nn.Module, pattern: str, names: list[str]) -> str:
    """``pattern``, or it under the base model's prefix where only that names a module."""
    prefix = getattr(model, "base_model_prefix", "")
    if not prefix or any(fnmatch.fnmatchcase(name, pattern) for name in names):
        return pattern
    return f"{prefix}.{pattern}"


def config_plan(model: nn.Module) -> dict[str, str]:
    """The model config's ``base_model_tp_plan`` ({} where it has none)."""
    return dict(getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {})


def class_plan(model: nn.Module) -> dict[str, str]:
    """The model class's ``_tp_plan`` ({} where it has none): read from the class, as
    Hugging Face declares it there (an instance may hold a merged copy)."""
    return dict(getattr(type(model), "_tp_plan", None) or {})


def _refuse_inexact(source: str, plan: dict[str, str], taken: dict[str, str]) -> None:
    for pattern, kind in plan.items():
        if pattern not in taken:
            raise ValueError(
                f"{source} makes {pattern!r} {kind!r}, which has no exact counterpart here "
                f"(paratrain takes {', '.join(EXACT)}); pass the plan without it, "
                f"tp_plan={taken!r}, or leave tp_plan out for the plan paratrain finds."
            )


def _head_kind(model: nn.Module, pattern: str, tensor: int | None, vocab: set[str]) -> str:
    """``vocab`` for a gathered head where that cut is possible, else ``replicate``
    followed by why (``replicate: ...``)."""
    modules = dict(model.named_modules())
    matched = [name for name in modules if fnmatch.fnmatchcase(name, pattern)]
    for name in matched:
        module = modules[name]
        if not isinstance(module, nn.Linear):
            return f"replicate: {name!r} is a {type(module).__name__}, not an nn.Linear"
        if tensor and module.out_features % tensor:
            return f"replicate: tensor={tensor} does not divide its {module.out_features} ids"
        for other, held in model.named_modules(remove_duplicate=False):
            tied = any(p is module.weight for p in held.parameters(recurse=False))
            covered = any(fnmatch.fnmatchcase(other, p) for p in vocab)
            if tied and other != name and not covered:
                return f"replicate: its weight is tied to {other!r}, which the plan keeps whole"
    return "vocab"


def auto_entries(model: nn.Module, tensor: int | None = None) -> list[Entry]:
    """What ``tp_plan="auto"`` applies to ``model`` at ``tensor`` (None: not known yet),
    entry by entry; refused where the model has neither plan or a kind is not exact."""
    base, own = config_plan(model), class_plan(model)
    if not base and not own:
        raise ValueError(
            f"tp_plan='auto' takes the Hugging Face config's base_model_tp_plan and the "
            f"class's _tp_plan, but {type(model).__name__} has neither; leave tp_plan out "
            f"for the plan paratrain finds, or name the layers, such as tp_plan={{'*.up': "
            f"'colwise', '*.down': 'rowwise'}}."
        )
    names = [name for name, _ in model.named_modules()]
    config_source = f"{type(getattr(model, 'config', None)).__name__}.base_model_tp_plan"
    _refuse_inexact(config_source, base, {p: k for p, k in base.items() if k in EXACT})
    entries = [Entry(_prefixed(model, p, names), EXACT[k], config_source) for p, k in base.items()]
    class_source = f"{type(model).__name__}._tp_plan"
    taken = {p: k for p, k in own.items() if k in EXACT or k in GATHERED_HEAD}
    _refuse_inexact(class_source, own, taken)
    for pattern, kind in own.items():
        if kind in EXACT:
            entries.append(Entry(pattern, EXACT[kind], class_source))
            continue
        vocab = {e.pattern for e in entries if e.kind == "vocab"} | {pattern}
        ours = _head_kind(model, pattern, tensor, vocab)
        why = ours.partition(": ")[2]
        source = f"{class_source}'s {kind}" + (f" ({why})" if why else "")
        entries.append(Entry(pattern, ours.partition(":")[0], source))
    return entries


def translated(
    model: nn.Module, tp_plan: dict[str, str] | str, tensor: int | None = None
) -> dict[str, str]:
    """``tp_plan`` (or the model's own, for "auto") in our kinds and full module names."""
    if tp_plan == AUTO:
        return {entry.pattern: entry.kind for entry in auto_entries(model, tensor)}
    if not isinstance(tp_plan, dict):
        return tp_plan
    names = [name for name, _ in model.named_modules()]
    exact = {p: k for p, k in tp_plan.items() if not isinstance(k, str) or k in EXACT}
    _refuse_inexact("tp_plan", tp_plan, exact)
    return {_prefixed(model, p, names): EXACT.get(k, k) for p, k in tp_plan.items()}


def applied_line(model: nn.Module, tensor: int | None = None) -> str:
    """What ``tp_plan='auto'`` applied, entry by entry with its source, in one line."""
    entries = "; ".join(f"{e.pattern} {e.kind} ({e.source})" for e in auto_entries(model, tensor))
    return f"tp_plan='auto' applied: {entries}"
