"""Lookahead pulls: an asynchronous worker computes its gradient where it will be applied.

Why: a push that is ``tau`` updates stale was computed on parameters the server has
since moved ``tau`` steps away from, and under Adam that costs asynchronous ps about half
its samples even with the staleness-aware rate (``stale_lr``). Consecutive steps point
much the same way (that is what Adam's momentum does), so the server can estimate where
the parameters will be when this worker's next push lands: ``tau`` more steps along the
last one. A pull for a step returns ``w + tau * (w - w_before_last_step)``, with ``tau``
the staleness of this worker's previous push (its typical lag, since it depends mostly on
the worker's speed against the others'). This is the idea of DANA (Hakimi et al. 2019,
"Taming momentum in a distributed asynchronous environment"), which extrapolates along
the momentum, here along the last step so that it holds for any optimizer.

Measured in a simulation of ``benchmarks/bench_ps.py`` (three workers and one 3.6x
slower, the real quick-start gpt, its Adam steps and staleness pattern; the simulation
reproduced the benchmark's loss for plain asynchronous ps, 2.62 against 2.63): reaching
dp's target loss took 1.69x to 2.04x dp's samples without lookahead and 1.21x to 1.23x
with it, over three seeds.

What it costs: one copy of the shard before every optimizer step (to know the last
step), and a pull reads two tensors instead of one. Only step pulls look ahead:
``eval_step`` and ``state_dict`` read the parameters as they are, and a worker with no
push yet, or synchronous rounds (``staleness=0``: pushes are never stale there), get
exact parameters. A parameter load or set forgets the last step (it was no step).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class PullLookahead:
    """One server's last step and its workers' lags; extrapolated pulls from them."""

    def __init__(self, flats: Sequence[torch.Tensor]) -> None:
        self._flats = list(flats)
        self._before: list[torch.Tensor] | None = None  # the flats before the last step
        self._step_known = False
        self._lag: dict[int, int] = {}  # worker -> staleness of its last push

    def before_step(self) -> None:
        """Remember the parameters as they are just before an optimizer step."""
        if self._before is None:
            self._before = [torch.empty_like(flat) for flat in self._flats]
        for saved, flat in zip(self._before, self._flats, strict=True):
            saved.copy_(flat)
        self._step_known = True

    def forget_step(self) -> None:
        """The parameters were overwritten (set or loaded): that was no step to follow."""
        self._step_known = False

    def note_push(self, worker: int, staleness: int) -> None:
        self._lag[worker] = max(0, staleness)

    def steps_ahead(self, worker: int) -> int:
        """How many steps along the last one ``worker``'s next pull looks (0: exact)."""
        return self._lag.get(worker, 0) if self._step_known else 0

    def write(self, worker: int, out: Sequence[torch.Tensor]) -> None:
        """The parameters ``worker`` should compute on, written into ``out`` (one tensor
        per flat): extrapolated where this worker lags and the last step is known."""
        ahead = self.steps_ahead(worker)
        for index, (target, flat) in enumerate(zip(out, self._flats, strict=True)):
            if ahead and flat.is_floating_point():
                # lerp(before, w, 1 + a) = w + a * (w - before), in one pass.
                torch.lerp(self._before[index], flat, 1.0 + ahead, out=target)
            else:
                target.copy_(flat)

    def extrapolated(self, worker: int) -> list[torch.Tensor] | None:
        """New tensors holding what :meth:`write` would write; None when it is exact."""
        if not self.steps_ahead(worker):
            return None
        out = [torch.empty_like(flat) for flat in self._flats]
        self.write(worker, out)
        return out
