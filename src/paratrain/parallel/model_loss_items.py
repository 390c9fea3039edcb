"""A Hugging Face model's own loss made the global batch's token mean.

With the labels inside a dict batch and ``loss_fn=lambda outputs, _: outputs.loss``, each
forward returns its part's token mean; averaging parts with unequal counts of real tokens
(uneven padding) is not the global batch's mean (issue 25 item 3: DDP is off the same
way). Recent Hugging Face models take ``num_items_in_batch`` and then divide their summed
loss by it, which is how their Trainer fixed this. So where the batch is a dict with
``labels`` and the model takes it, every part's forward gets the global batch's count of
labelled tokens, shifted as the model's causal loss shifts them (``labels[..., 1:] !=
-100``), divided by the number of equal parts the engine averages (micro-batches times
replicas): ``outputs.loss`` is then ``parts x`` the part's sum over the global count, and
the engines' average of the parts' losses, unchanged, is the global token mean. Passing
the count so (rather than the count itself and summing the parts) keeps every
``loss_fn`` right: one that reads ``outputs.loss`` linearly gets the global mean, one
that ignores it is untouched. Where the model does not take it, a notice says once that
its loss is each share's mean and names ``paratrain.losses.causal_lm_cross_entropy``,
which is exact under every split.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch
from torch import nn

from paratrain.losses import IGNORE_INDEX
from paratrain.runtime import comm

KEYWORD = "num_items_in_batch"
_SAID: set[str] = set()


def takes_num_items(model: nn.Module) -> bool:
    """Whether ``model``'s forward takes ``num_items_in_batch``: named, or (Hugging Face's
    Trainer's rule) through ``**kwargs`` of a model that computes its own loss."""
    explicit = getattr(model, "accepts_loss_kwargs", None)
    if explicit is not None:
        return bool(explicit)
    parameters = inspect.signature(model.forward).parameters
    if KEYWORD in parameters:
        return True
    var_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    return var_keyword and hasattr(type(model), "loss_function")


def labelled_tokens(inputs: Any) -> int | None:
    """The global batch's count of tokens a causal LM's loss counts, if it has labels."""
    if not isinstance(inputs, dict) or not isinstance(inputs.get("labels"), torch.Tensor):
        return None
    return int((inputs["labels"][..., 1:] != IGNORE_INDEX).sum())


def with_num_items(model: nn.Module, inputs: Any, parts: int, loss_fn: Any) -> int | None:
    """The count to pass as ``num_items_in_batch`` (None: pass nothing); says once where
    a model that does not take it averages its parts' means."""
    items = labelled_tokens(inputs)
    if items is None or KEYWORD in inputs:
        return None
    if takes_num_items(getattr(model, "_orig_mod", model)):  # torch.compile's wrapper
        return items
    if parts > 1 and getattr(loss_fn, "count", None) is None and type(model).__name__ not in _SAID:
        _SAID.add(type(model).__name__)
        if comm.rank() == 0:
            print(
                f"paratrain: the batch carries labels, but {type(model).__name__}.forward "
                f"takes no {KEYWORD}, so its own loss is each of the {parts} parts' token "
                "mean, averaged: not the global batch's where padding is uneven; "
                "loss_fn=paratrain.losses.causal_lm_cross_entropy is exact.",
                file=sys.stderr,
                flush=True,
            )
    return None


def part_inputs(part: Any, items: int | None, parts: int, *, as_tensor: bool = True) -> Any:
    """A part's dict batch with ``items / parts`` added (as it is where ``items`` is None).

    ``as_tensor=False`` passes a Python number, which Hugging Face's loss divides by just
    the same: the pipeline's stages hand every tensor among a block's arguments to the next
    stage, and Hugging Face passes its forward's keywords on to every block, so a tensor
    count would travel between stages (and take a gradient) for nothing."""
    if items is None:
        return part
    return {**part, KEYWORD: torch.tensor(items / parts) if as_tensor else items / parts}
