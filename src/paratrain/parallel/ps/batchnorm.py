"""ps refuses BatchNorm running statistics at more than one worker.

Why: the servers hold the parameters only. A buffer such as BatchNorm's running mean and
variance stays on each worker, which updates it from its own shares, so the workers
would evaluate with different statistics and a checkpoint would hold those of whichever
worker saved it (measured: synchronous ps at 2 workers, 10 steps of a small
BatchNorm model: the workers' running means 4-7 % apart, ``eval_step`` 1.7437 on one and
1.7406 on the other). Keeping them equal would take a message between workers, which ps
never sends; dp and zero1-3 send the first replica's statistics as DDP does, or
synchronise them (``sync_batchnorm=True``), so the refusal names them.
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


def check_batchnorm(model: nn.Module, workers: int) -> None:
    """Refuse a model whose BatchNorm layers track running statistics, at 2+ workers."""
    if workers < 2:
        return
    norms = [
        name
        for name, module in model.named_modules()
        if isinstance(module, _BatchNorm) and module.track_running_stats
    ]
    if norms:
        raise ValueError(
            f"strategy 'ps' would keep the running statistics of BatchNorm layer "
            f"{norms[0]!r} apart on each worker (its servers hold only parameters), so "
            "workers would evaluate and save different ones; use strategy 'dp' or "
            "'zero1'..'zero3', which share the first replica's statistics as DDP does "
            "(or synchronise them with sync_batchnorm=True)."
        )
