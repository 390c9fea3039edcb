"""Synchronous rounds with backup workers: a version needs only the first N - b pushes.

Why: under ``staleness=0`` every version waits for every worker, so one slow worker
paces the whole job, exactly as under dp. Asynchronous ps does not wait, but under Adam
its pushes, two or three versions stale, cost about twice the samples to reach the same
loss (``benchmarks/stale_adam.py``). Chen et al. (2016, "Revisiting distributed
synchronous SGD") keep the synchronous step and drop the wait: with ``b`` backup
workers a version is taken from the first ``N - b`` pushes computed on it, and the
slowest workers' pushes arrive late. TensorFlow's ``SyncReplicasOptimizer`` discards late
pushes; here a late push is folded into the version that is open when it arrives,
weighted by the staleness-aware factor of ``stale_lr`` (1 / (staleness + 1) under "inverse"),
so that the straggler's samples still count and nothing it computed is thrown away.

Rules, all per server (each server counts the pushes it received, in its own order):

- a push computed on the open version is *fresh*; the version closes once the fresh
  pushes number ``quorum(live workers, b)``, or once no live worker is left;
- a worker that pushed fresh pulls again only after the version it pushed on closed,
  so no worker ever computes twice on one version; a worker whose push was late pulls
  at once;
- the step is the weighted mean of the gradients the round carried (weight 1 when fresh).

With ``b = 0`` this is the plain synchronous round and none of it applies.
"""

from __future__ import annotations


def check_backup_workers(backup: object, staleness: int | None, workers: int) -> int:
    """Refuse a backup count that is not an integer in 0..workers-1, or one without
    ``staleness=0`` (the other modes never wait for a slow worker to begin with)."""
    if isinstance(backup, bool) or not isinstance(backup, int) or backup < 0:
        raise ValueError(f"backup_workers must be a non-negative integer, not {backup!r}.")
    if backup and staleness != 0:
        raise ValueError(
            f"backup_workers applies to synchronous ps only: pass staleness=0 with it, or "
            f"drop backup_workers (staleness={staleness!r} never waits for the slowest "
            "worker anyway)."
        )
    if backup >= max(workers, 1):
        raise ValueError(
            f"backup_workers must be less than the number of workers ({workers}), not "
            f"{backup}: at least one push must make a version."
        )
    return backup


def quorum(live_workers: int, backup: int) -> int:
    """Fresh pushes that close a version: all live workers but ``backup``, at least one."""
    return max(1, live_workers - backup)
