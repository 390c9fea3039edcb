"""``--elastic`` where a dead worker takes state with it: go on from the newest checkpoint.

Why a checkpoint and not the survivors' memory: zero2 keeps each optimizer shard (and each
gradient shard) on one worker only, so after a death no survivor holds that worker's
part of the optimizer state, and going on from what the survivors hold would not be the
run's function. The newest complete checkpoint holds all of it in canonical names and
loads at any worker count (``tests/test_checkpoint_resharding.py``), and every count from
``--min-devices`` up splits the global batch evenly (``elastic_checks``): so the survivors
are restarted from it at their own count, and the steps since it are computed again on
the same global batches. That is exact; what it costs is those steps and the relaunch.
"""

from __future__ import annotations

import sys
from pathlib import Path

from paratrain.checkpoints.format import Checkpoint
from paratrain.checkpoints.locate import latest_checkpoint
from paratrain.config import TrainConfig
from paratrain.reports.metrics_file import append_records, read_metrics
from paratrain.runtime.elastic import survivors_of
from paratrain.runtime.launch import WorkerError, dead_ranks

__all__ = ["go_on_from_checkpoint", "lost_state"]


def go_on_from_checkpoint(
    config: TrainConfig, error: WorkerError, run_dir: Path, devices: int
) -> tuple[int, Path | None]:
    """After ``error`` (a worker died) in a run of ``devices`` workers: the survivors'
    count and the checkpoint they restart from (None: the start), said in one line and
    written as a ``workers`` record; ``error`` is raised again where fewer than
    ``--min-devices`` are left or it was not a death (a SIGTERM)."""
    named = lost_state(error)  # shard copies that could not cover a death: they say who is left
    lost = dead_ranks(error) if named is None else sorted(set(range(devices)) - set(named))
    survivors = devices - len(lost)
    checkpoint = latest_checkpoint(run_dir)
    step = Checkpoint(checkpoint).step if checkpoint else 0
    where = f"checkpoint {checkpoint} (step {step})" if checkpoint else "the start"
    if error.terminated or not lost or survivors < config.min_devices:
        if survivors < config.min_devices:
            print(
                f"paratrain: {len(lost)} worker(s) lost leaves {survivors}, fewer than "
                f"--min-devices {config.min_devices}; the run stops (resume from {where}).",
                file=sys.stderr,
            )
        raise error
    why = f"{config.strategy} keeps state that no survivor holds"
    if named is not None:
        why = f"the survivors' shard copies do not cover every slice of {config.strategy}'s state"
    print(
        f"paratrain: worker {', '.join(map(str, lost))} lost; {why}, so the {survivors} "
        f"survivors restart from {where}.",
        file=sys.stderr,
    )
    _record(run_dir / "metrics.jsonl", lost, devices, survivors, step)
    return survivors, checkpoint


def lost_state(error: WorkerError) -> list[int] | None:
    """The survivors' launch ranks where they stopped because no one held a slice of the
    state (``ElasticStateLost``), else None. A rank that never regrouped (killed) counts
    as lost."""
    for details in error.failures.values():
        survivors = survivors_of(details)
        if survivors is not None:
            return survivors
    return None


def _record(metrics: Path, lost: list[int], old: int, new: int, step: int) -> None:
    """The ``workers`` record: the step in flight (the one after the last logged: exact
    with ``--log-every 1``), the steps computed again from the checkpoint's, and the
    seconds the failed attempt spent on them (from its checkpoint's train record to its
    last; the relaunch is not counted)."""
    records = read_metrics(metrics) if metrics.exists() else []
    starts = [i for i, r in enumerate(records) if r["kind"] == "config"]
    attempt = records[starts[-1] :] if starts else []
    train = [r for r in attempt if r["kind"] == "train"]
    in_flight = (train[-1]["step"] + 1) if train else step + 1
    since = [r["time_s"] for r in train if r["step"] >= step]
    change = {
        "kind": "workers",
        "time_s": round(train[-1]["time_s"], 4) if train else 0.0,
        "step": in_flight,
        "old_workers": old,
        "new_workers": new,
        "lost_ranks": lost,
        "joined_ranks": [],
        "seconds_lost": round(since[-1] - since[0], 3) if since else 0.0,
        "steps_redone": in_flight - step,
        "from_checkpoint_step": step,
    }
    append_records(metrics, [change])
