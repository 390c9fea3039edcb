"""Stale synchronous parallel bookkeeping of one server: clocks, the bound, the histogram.

A worker's clock is the number of pushes this server has received from it. A worker at
clock ``c`` may pull (and so start its next step) once ``c - min(clock of live workers)
<= bound``: with bound 0 nobody starts step ``c + 1`` before every live worker has pushed
step ``c`` (synchronous), with bound ``k`` the fastest runs at most ``k`` steps ahead of
the slowest, and with no bound workers never wait for each other (asynchronous).

Workers that finished (said goodbye) or died stop counting towards the minimum, which is
what lets the others go on without them. The staleness of a push is how many updates this
server applied between the pull its gradient was computed from and the push itself; the
histogram counts pushes that carried a gradient, and pushes that carried none (an fp16
overflow on that worker) are counted per worker instead.
Pure bookkeeping (no locks, no messages): the server holds its lock around every call.
"""

from __future__ import annotations

import time
from collections import Counter


def check_bound(staleness: object) -> int | None:
    """Refuse a staleness that is neither None (asynchronous) nor a non-negative integer."""
    if staleness is None:
        return None
    if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
        raise ValueError(
            f"staleness must be a non-negative integer (0 = synchronous) or None "
            f"(asynchronous), not {staleness!r}."
        )
    return staleness


class StalenessBook:
    """Clocks, liveness and push statistics of the workers of one server."""

    def __init__(self, workers: int, bound: int | None) -> None:
        self.bound = check_bound(bound)
        self.clocks = [0] * workers
        self.live = set(range(workers))
        self.lost: dict[int, str] = {}
        self.histogram: Counter[int] = Counter()
        self.skipped: Counter[int] = Counter()
        self._first_seen: dict[int, float] = {}
        self._last_push: dict[int, float] = {}

    def seen(self, worker: int) -> None:
        """Note a worker's first request: its push rate is measured from here."""
        self._first_seen.setdefault(worker, time.monotonic())

    def record_push(self, worker: int, staleness: int, *, skipped: bool = False) -> None:
        """A push moves the worker's clock whether or not it carried a gradient."""
        self.clocks[worker] += 1
        if skipped:
            self.skipped[worker] += 1
        else:
            self.histogram[max(0, staleness)] += 1
        self._last_push[worker] = time.monotonic()

    def slowest_clock(self) -> int | None:
        """The minimum clock over live workers (None once none is left)."""
        return min((self.clocks[w] for w in self.live), default=None)

    def may_pull(self, worker: int) -> bool:
        """Whether ``worker`` may start its next step without breaking the bound."""
        slowest = self.slowest_clock()
        if self.bound is None or slowest is None:
            return True
        return self.clocks[worker] - slowest <= self.bound

    def everyone_pushed(self, clock: int) -> bool:
        """Whether every live worker has pushed at least ``clock`` times."""
        return all(self.clocks[w] >= clock for w in self.live)

    def retire(self, worker: int, *, lost: str | None = None) -> None:
        """A worker finished (``lost`` None) or died (``lost`` says how).

        A worker that dies after it finished is not lost: it had nothing more to push.
        """
        if lost is not None and worker in self.live:
            self.lost[worker] = lost
        self.live.discard(worker)

    def pushes_per_s(self) -> dict[int, float]:
        """Pushes per second of each worker, from its first request to its last push."""
        rates = {}
        for worker, last in self._last_push.items():
            elapsed = last - self._first_seen.get(worker, last)
            rates[worker] = self.clocks[worker] / elapsed if elapsed > 0 else 0.0
        return rates

    def summary(self) -> dict:
        """JSON-ready statistics (keys are strings, as JSON needs)."""
        return {
            "pushes": {str(w): c for w, c in enumerate(self.clocks)},
            "pushes_per_s": {str(w): r for w, r in sorted(self.pushes_per_s().items())},
            "staleness_histogram": {str(s): n for s, n in sorted(self.histogram.items())},
            "skipped_pushes": {str(w): self.skipped[w] for w in range(len(self.clocks))},
            "lost_workers": {str(w): why for w, why in sorted(self.lost.items())},
        }
