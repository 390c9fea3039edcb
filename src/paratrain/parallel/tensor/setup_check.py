"""A split attention compared with the whole one on the first batch, before any step.

An attention we recognise by its shape (``heads``) keeps its own forward, which we did
not write and could not trace: that it computes on a slice what it computes whole is
checked, not assumed. Before the split, each such module is copied whole; at its first
call (the first batch, on every rank, the same call on each member of the tensor group)
the copy takes the split module's current weights, joined from the slices (a checkpoint
may have been loaded since the split), and the split module and the copy run on the same
arguments, both in eval mode (no dropout drawn, so the random streams are untouched) and
without a key-value cache, and a difference beyond the fp32 bound refuses the run. The
copy is then dropped.

The bound: both run the same fp32 operations per head except the output projection's
sum over its ``n`` input features, which the split adds as ``tensor`` partial sums. A
sum of ``n`` products is within ``n u sum_j |W_ij| |a_j|`` of the exact one (Higham's
gamma_n, u = 2^-24), so the two differ by at most twice that; q, k and v, whose rows are
each one rank's alone, may be blocked otherwise by the matmul and differ by their own
such bound, which attention carries forward at most as large. We allow
``4 n u max_i sum_j |W_ij| |a_j|``, computed from the whole module's own ``W`` and ``a``.
A wrong split (a head reading another's keys, a width taken from the whole input) is off
by the size of the output itself.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from paratrain.parallel.tensor import mappings
from paratrain.parallel.tensor.detect import is_conv1d
from paratrain.parallel.tensor.heads import attention_shape

UNIT = 2.0**-24
Join = Callable[[str, torch.Tensor], torch.Tensor]
"""A canonical state name and this worker's value -> the whole tensor (``TensorSplit``)."""
CACHE_KEYWORDS = ("cache", "past_key_values", "past_key_value", "layer_past", "use_cache")
"""Keywords that would let a second call see the first one's keys: passed as None."""


def _tensors(output) -> list[torch.Tensor]:
    items = output if isinstance(output, (tuple, list)) else [output]
    return [item for item in items if isinstance(item, torch.Tensor)]


def _scale(projection: nn.Module, inputs: torch.Tensor) -> float:
    """``max_i sum_j |W_ij| |a_j|`` of a Linear or Conv1D on its input ``inputs``."""
    weight = projection.weight.detach().abs()
    weight = weight if is_conv1d(projection) else weight.t()
    return float((inputs.detach().abs().to(weight.dtype) @ weight).max())


class FirstForwardCheck:
    """The forward hook that compares a split attention with its whole copy once.

    The copy first takes the split module's weights as they are at that call, joined
    from every member's slices (``join``: a canonical name and this worker's slice -> the
    whole tensor; collective over the tensor group, whose members all reach this call):
    a checkpoint loaded between the split and the first batch (a resume) changed them."""

    def __init__(self, name: str, whole: nn.Module, join: Join) -> None:
        self.name, self.whole, self.join = name, whole, join
        self.handle = None

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, output) -> None:
        self.handle.remove()
        whole, self.whole = self.whole, None
        with torch.no_grad():
            state = module.state_dict()
            whole.load_state_dict(
                {k: self.join(f"{self.name}.{k}", v).to(v.device) for k, v in state.items()}
            )
        kwargs = {k: (None if k in CACHE_KEYWORDS else v) for k, v in kwargs.items()}
        shape = attention_shape(whole)
        projection = getattr(whole, shape.output)
        seen: list[torch.Tensor] = []
        hook = projection.register_forward_pre_hook(lambda _, a: seen.append(a[0]))
        calls, sent = mappings.CALLS.copy(), mappings.BYTES.copy()
        training = module.training
        try:
            with torch.no_grad():
                module.eval()
                split = _tensors(module(*args, **kwargs))
                reference = _tensors(whole.eval()(*args, **kwargs))
        finally:
            hook.remove()
            module.train(training)
            mappings.CALLS.clear(), mappings.CALLS.update(calls)
            mappings.BYTES.clear(), mappings.BYTES.update(sent)
        width = seen[0].shape[-1]
        bound = 4 * width * UNIT * _scale(projection, seen[0])
        # the attention's output; what else it returns (eager attention's weights) is per head
        off = float((split[0] - reference[0]).abs().max())
        if off > bound:
            raise ValueError(
                f"attention {self.name!r} ({type(whole).__name__}) split by heads computes "
                f"another function on the first batch (off by {off:.3g}, beyond the fp32 "
                f"bound {bound:.3g}): its forward does not take the per-slice head counts "
                f"paratrain sets; make its projections replicate in tp_plan."
            )


def keep_wholes(model: nn.Module, names: tuple[str, ...]) -> dict[str, nn.Module]:
    """A whole copy of each attention in ``names`` that keeps a forward we did not write."""
    wholes = {}
    for name in names:
        module = model.get_submodule(name)
        if attention_shape(module).kind != "reference":
            wholes[name] = copy.deepcopy(module)
    return wholes


def arm(model: nn.Module, wholes: dict[str, nn.Module], join: Join) -> None:
    """Check each split attention against its whole copy at its first forward."""
    for name, whole in wholes.items():
        check = FirstForwardCheck(name, whole, join)
        module = model.get_submodule(name)
        check.handle = module.register_forward_hook(check, with_kwargs=True)
