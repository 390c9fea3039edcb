"""Gradient clipping under ps: what ``max_grad_norm`` means in each mode, and the servers'
exchange of squared norms that makes a synchronous round clip by the global norm.

Synchronous rounds (``staleness=0``): a round's gradient is the mean of the workers'
pushes, held sharded over the servers, and it must be clipped as ``clip_grad_norm_`` clips
the global batch's gradient on one device. Its square norm is the sum of the servers'
square norms of their averaged shards, so once a server's round closes it sends its own
(float64) to every other server and receives theirs, point-to-point on the gloo group the
servers already share with the workers, then every server scales its shard by
``min(1, max_norm / (norm + 1e-6))`` before its optimizer step. Why the servers and not
the workers: a worker holds only its own share's gradient, and the norm of the mean is not
a function of the shares' norms, so workers could compute it only by exchanging whole
gradients, which is the all-reduce ps exists to avoid; the servers hold the mean already,
and one float per server pair per round is all they need. Every server adds the values in
server order, so all of them get the same norm to the bit, and it rides back to the
workers on the round's reply (``StepStats.grad_norm``, the norm before clipping).

Asynchronous and bounded runs (``staleness`` >= 1 or None): a server applies each push as
an optimizer step of its own, computed from one worker's share, so the gradient of that
step is the push itself. Clipping it by its own norm is exactly ``clip_grad_norm_`` on
the step that is taken (as asynchronous systems clip each worker's gradient), and the
worker, which holds that whole gradient, clips it before pushing, with no message;
``StepStats.grad_norm`` is then its share's norm.

Backup workers are refused: each server closes a version on the first N - b pushes that
reach it, so the servers' shards of a version need not come from the same pushes and
make no one gradient whose norm could be taken.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from paratrain.parallel.clipping import check_max_grad_norm, clip_coefficient, squared_norm
from paratrain.parallel.ps.protocol import NORM_TAG, post_recv, wait_all


def check_clipping(max_grad_norm: float | None, backup_workers: int) -> float | None:
    """Refuse clipping with backup workers (see the module docstring), with the reason."""
    max_grad_norm = check_max_grad_norm(max_grad_norm)
    if max_grad_norm is not None and backup_workers:
        raise ValueError(
            "strategy 'ps' cannot clip by the global gradient norm with backup workers: each "
            "server closes a version on its own first pushes, so the servers' shards are not "
            "one gradient; drop max_grad_norm or backup_workers."
        )
    return max_grad_norm


class RoundClipper:
    """One server's side of clipping a synchronous round by the global norm.

    ``rank`` is this server's rank in the gloo group and ``server_ranks`` every server's,
    in server order. Called with the server's lock held, from whichever thread closed the
    round; every server closes every round once, so the n-th exchange of each server pairs
    with the n-th of the others (messages of one pair and tag arrive in the order sent).
    """

    def __init__(self, group, rank: int, server_ranks: Sequence[int], max_norm: float) -> None:
        self.group, self.rank = group, rank
        self.server_ranks = list(server_ranks)
        self.max_norm = max_norm

    def clip(self, flats: Sequence[torch.Tensor] | None) -> float:
        """Scale ``flats`` (this server's averaged shard, or None when the round carried no
        gradient) in place; returns the global norm before clipping (NaN for None)."""
        own = squared_norm(flats or (), device=torch.device("cpu"))
        total = torch.sqrt(self._sum_over_servers(own)).float()
        if not flats:
            return float("nan")
        coefficient = clip_coefficient(total, self.max_norm)
        torch._foreach_mul_(list(flats), coefficient)
        return float(total)

    def _sum_over_servers(self, own: torch.Tensor) -> torch.Tensor:
        """Every server's square norm, added in server order (the same sum everywhere)."""
        values = {r: torch.empty(1, dtype=torch.float64) for r in self.server_ranks}
        values[self.rank] = own.reshape(1)
        others = [r for r in self.server_ranks if r != self.rank]
        works = [w for r in others for w in post_recv(self.group, [values[r]], r, NORM_TAG)]
        works += [self.group.send([values[self.rank]], r, NORM_TAG) for r in others]
        wait_all(works, None)  # a lost server ends the run anyway (see server.py)
        return torch.cat([values[r] for r in self.server_ranks]).sum()
