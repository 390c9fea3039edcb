"""Which optimizers the ZeRO engines may hand flat slices to.

A ZeRO rank optimizes only its slice of each flat unit (``shards``), which equals
optimizing the whole only when the update of every element depends on that element's own
parameter, gradient and state (and on step counters shared by all elements). The
``torch.optim`` classes listed in ``ELEMENTWISE`` are such. Anything else may mix
elements: LBFGS takes dot products over all parameters, Adafactor factors the second
moment over a matrix's rows and columns, Muon orthogonalises whole matrices, and a
gradient-norm clip inside ``step`` would see 1/N of the norm. On slices these compute a
different, wrong update without any error, so they are refused unless the user states
that their optimizer is elementwise (``elementwise_optimizer=True``).

The check is on the exact class: a subclass may override ``step`` and is refused too.
Parameter groups are carried over by ``groups`` (no slice mixes two groups); the
optimizer must then hold exactly the slices it was given, each once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
    torch.optim.ASGD,
    torch.optim.Rprop,
)
"""torch.optim classes whose update is elementwise (safe on flat slices)."""


def check_sharded_optimizer(
    optimizer: torch.optim.Optimizer,
    shards: Sequence[nn.Parameter],
    *,
    strategy: str,
    elementwise_optimizer: bool,
) -> None:
    """Refuse an optimizer that would compute a different update on flat slices.

    ``shards`` are the flat slices (and per-parameter pieces) the optimizer was built
    over; ``elementwise_optimizer`` is the user's statement that a class not in
    ``ELEMENTWISE`` updates each element alone.
    """
    kind = type(optimizer)
    if kind not in ELEMENTWISE and not elementwise_optimizer:
        raise ValueError(
            f"{strategy} updates each worker's flat slice of the parameters separately, which "
            f"is only correct for elementwise optimizers and {kind.__module__}.{kind.__name__} "
            "is not known to be one; use an elementwise torch.optim optimizer (Adam, AdamW, "
            "SGD, ...), strategy='dp', or pass elementwise_optimizer=True if its update of "
            "each element depends only on that element."
        )
    given = {id(shard) for shard in shards}
    held = [id(param) for group in optimizer.param_groups for param in group["params"]]
    if len(held) != len(given) or set(held) != given:
        raise ValueError(
            f"{strategy} needs the optimizer factory to build its optimizer over exactly "
            f"the {len(given)} flat slice(s) it is given (it holds {len(held)} tensor(s) in "
            f"{len(optimizer.param_groups)} group(s)), because each slice stands for a part "
            "of the model's parameters; build it from the parameters it is given, as in "
            "`lambda params: torch.optim.Adam(params, lr=1e-3)`, or use strategy='dp'."
        )
