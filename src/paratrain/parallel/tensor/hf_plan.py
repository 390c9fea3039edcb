"""Hugging Face's tensor-parallel plans read as ours.

A Hugging Face model's config carries ``base_model_tp_plan`` (what
``from_pretrained(tp_plan="auto")`` applies): patterns relative to the base model
(``layers.*.self_attn.q_proj``) mapped to Hugging Face's kinds. ``tp_plan="auto"`` takes
it; a plan passed as is may use those names too. Patterns get the base model's prefix
(``model.`` in ``LlamaForCausalLM``) where the pattern alone names nothing. Only kinds
with an exact counterpart here are taken (``EXACT``); the others (``colwise_rep``,
``local_*``, ``gather``, ``sequence_parallel``, ...) change where outputs are gathered or
rely on DTensor's layouts, and are refused with the plan that would work without them.
"""

from __future__ import annotations

import fnmatch

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


def _prefixed(model: nn.Module, pattern: str, names: list[str]) -> str:
    """``pattern``, or it under the base model's prefix where only that names a module."""
    prefix = getattr(model, "base_model_prefix", "")
    if not prefix or any(fnmatch.fnmatchcase(name, pattern) for name in names):
        return pattern
    return f"{prefix}.{pattern}"


def config_plan(model: nn.Module) -> dict[str, str]:
    """The model config's ``base_model_tp_plan``, or a sentence saying there is none."""
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise ValueError(
            f"tp_plan='auto' takes the Hugging Face config's base_model_tp_plan, but "
            f"{type(model).__name__} has none; leave tp_plan out for the plan paratrain "
            f"finds, or name the layers, such as tp_plan={{'*.up': 'colwise', "
            f"'*.down': 'rowwise'}}."
        )
    return dict(plan)


def translated(model: nn.Module, tp_plan: dict[str, str] | str) -> dict[str, str]:
    """``tp_plan`` (or the config's, for "auto") in our kinds and full module names."""
    source = "tp_plan"
    if tp_plan == AUTO:
        tp_plan = config_plan(model)
        source = f"{type(model.config).__name__}.base_model_tp_plan"
    if not isinstance(tp_plan, dict):
        return tp_plan
    names = [name for name, _ in model.named_modules()]
    exact = {p: k for p, k in tp_plan.items() if not isinstance(k, str) or k in EXACT}
    for pattern, kind in tp_plan.items():
        if pattern not in exact:
            raise ValueError(
                f"{source} makes {pattern!r} {kind!r}, which has no exact counterpart here "
                f"(paratrain takes {', '.join(EXACT)}); pass the plan without it, "
                f"tp_plan={exact!r}, or leave tp_plan out for the plan paratrain finds."
            )
    return {_prefixed(model, p, names): EXACT.get(k, k) for p, k in tp_plan.items()}


def applied_line(model: nn.Module, plan: dict[str, str]) -> str:
    """What ``tp_plan='auto'`` applied, in one line for the log."""
    entries = ", ".join(f"{pattern} {kind}" for pattern, kind in plan.items())
    return f"tp_plan='auto': {type(model.config).__name__}.base_model_tp_plan applied: {entries}"
