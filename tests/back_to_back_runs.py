"""A synthetic timeline of pipeline steps run back to back, written as the engine writes
one, for tests/test_replay.py and tests/test_benchmarks.py."""

from __future__ import annotations

import json
from pathlib import Path

from paratrain.parallel.pipeline.schedule_clock import back_to_back, place_actions
from paratrain.parallel.pipeline.schedules import build_schedule
from paratrain.parallel.pipeline.timeline import Timeline, read_timeline

KINDS = {"F": "forward", "B": "backward", "W": "weight"}
PAUSE = 1e-3
"""Each stage's seconds on its own between two steps (its optimizer step)."""


def back_to_back_run(
    tmp_path: Path,
    times: dict[tuple[int, str], float],
    hop: float,
    *,
    began: bool,
    steps: int = 3,
) -> tuple[Timeline, list]:
    """``steps`` steps of ZB-H1's lists for steps back to back (2 stages, 4 micro-batches)
    on ``times`` (per (stage, kind)) and ``hop``, placed as one run, each stage ``PAUSE``
    on its own between steps, written as the engine writes them: the meta line says the
    steps do not end together, and with ``began`` each stage's record of when it began
    each step (its previous step's last pass and the pause done). Returns the timeline
    read back and the placement (each stage's (action, start, end), micro-batches of
    step k numbered from 4k)."""
    lists = build_schedule("zb-h1", 2, 4, flush=False)
    per_step = [len(row) for row in lists]

    def between(stage: int, position: int) -> float:
        return PAUSE if position % per_step[stage] == per_step[stage] - 1 else 0.0

    placed = place_actions(
        back_to_back(lists, steps),
        lambda stage, a: times[(stage, a.kind)],
        hop=hop,
        pause=between,
    )
    meta = {"kind": "meta", "stages": 2, "micro_batches": 4, "schedule": "zb-h1"}
    records = [{**meta, "replicas": 1, "flush": False}]
    for stage, row in enumerate(placed):
        for position, (a, start, end) in enumerate(row):
            step, first = divmod(position, per_step[stage])
            where = {"rank": stage, "stage": stage, "replica": 0, "step": step}
            if began and first == 0:
                free = row[position - 1][2] + PAUSE if position else 0.0
                records.append({"kind": "ready", **where, "start": 1.0 + free})
            event = {"kind": KINDS[a.kind], **where, "micro": a.micro - 4 * step}
            records.append({**event, "start": 1.0 + start, "end": 1.0 + end})
    path = tmp_path / "timeline.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return read_timeline(path), placed
