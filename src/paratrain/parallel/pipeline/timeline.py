"""Pipeline timelines: read what the workers recorded, measure the bubble, export a trace.

Every pipeline worker stamps the start and end of each forward and backward of each
micro-batch with ``time.perf_counter()``; on Linux that clock is system-wide monotonic, so
the stamps of all local workers line up without any clock synchronisation. The trainer
writes them to ``RUN_DIR/timeline.jsonl``: a ``meta`` header, one object per forward or
backward, one per stage and round saying when the stage began it (``ready``), and
optionally each stage's ``activation_peak``. JSON lines, like the metrics
file, so a run that dies still leaves a readable record and any tool can read it.

The point of all this is one number and one picture: how much of each step the stages spent
waiting (the pipeline *bubble*), next to the textbook ``(p - 1) / (m + p - 1)``, and a
timeline that shows where the waiting happened. A Chrome/Perfetto trace is written too, for
zooming into a long run.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from paratrain.parallel.pipeline.schedule_clock import timed_bubble
from paratrain.parallel.pipeline.schedules import SPLIT_SCHEDULES, zb_h2

__all__ = [
    "StageEvent",
    "Timeline",
    "TimelineError",
    "chrome_trace",
    "measured_bubble",
    "measured_steps",
    "median_step",
    "compact_ranges",
    "read_timeline",
    "schedule_bubble",
    "theoretical_bubble",
    "write_chrome_trace",
]

WORK_KINDS = ("forward", "backward", "weight")
READY_KIND = "ready"
"""A stage beginning a round of its schedule: free of the previous step's work."""

# Field -> expected type, per record kind. ``float`` accepts integers too; ``int`` refuses
# booleans (JSON ``true`` would otherwise pass as 1).
_FIELDS: dict[str, dict[str, type]] = {
    "meta": {"stages": int, "micro_batches": int, "schedule": str, "replicas": int},
    "forward": {
        "rank": int,
        "stage": int,
        "replica": int,
        "step": int,
        "micro": int,
        "start": float,
        "end": float,
    },
    "activation_peak": {"rank": int, "stage": int, "replica": int, "bytes": int},
    READY_KIND: {"rank": int, "stage": int, "replica": int, "step": int, "start": float},
}
_FIELDS["backward"] = _FIELDS["weight"] = _FIELDS["forward"]


class TimelineError(ValueError):
    """A timeline that cannot be used as it is; the message names the file and the fault."""


@dataclass(frozen=True)
class StageEvent:
    """One forward or backward of one micro-batch on one stage, in perf_counter seconds."""

    rank: int
    stage: int
    replica: int
    step: int
    kind: str
    micro: int
    start: float
    end: float
    chunk: int = 0
    """The virtual stage this worker ran (interleaved 1F1B; 0 where the record has none)."""

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    """A parsed ``timeline.jsonl``: the header, the work events in file order, the peak
    activation bytes keyed by ``(replica, stage)``, and when each stage began each step
    (``ready``)."""

    meta: dict[str, Any]
    events: list[StageEvent]
    activation_peaks: dict[tuple[int, int], int]
    ready: dict[tuple[int, int, int], float] = field(default_factory=dict)
    """``(replica, stage, step)`` -> when the stage began the step's first round (after
    its previous step's passes and optimizer step): steps run back to back can reach a
    stage before it is free (``PipelineEngine.flush``). Empty in older files."""

    @property
    def stages(self) -> int:
        return int(self.meta["stages"])

    @property
    def micro_batches(self) -> int:
        return int(self.meta["micro_batches"])

    @property
    def schedule(self) -> str:
        return str(self.meta["schedule"])

    @property
    def flush(self) -> bool:
        """Whether the run's stages ran the lists of steps that end together
        (``PipelineEngine.flush``: clipping, fp16, a tie across stages or a tensor split;
        ZB-H1's lists differ without); True where the meta line does not say."""
        return bool(self.meta.get("flush", True))

    @property
    def replicas(self) -> int:
        return int(self.meta["replicas"])

    @property
    def virtual_stages(self) -> int:
        """Chunks per stage (interleaved 1F1B); 1 where the meta line does not say."""
        return int(self.meta.get("virtual_stages", 1))

    def mean_times(self, replica: int = 0) -> dict[str, float]:
        """Mean seconds per pass of each kind over the whole run (of those it recorded), on
        the pieces fed by another: the first (stage 0's chunk 0) is fed data, so under a
        split backward its B sends nothing and is empty and its W is the whole backward
        (``split_backward.LayerTape``), which would read as no B and a long W."""
        events = [e for e in self.events if e.replica == replica]
        events = [e for e in events if (e.stage, e.chunk) != (0, 0)] or events
        means = {}
        for kind in WORK_KINDS:
            durations = [e.duration for e in events if e.kind == kind]
            if durations:
                means[kind] = sum(durations) / len(durations)
        return means

    def theory(self, replica: int = 0) -> tuple[float, str]:
        """This run's theoretical bubble and its formula (``schedule_bubble``), ZB-H1's
        from the run's own mean F, B and W times."""
        times = self.mean_times(replica) if self.schedule in SPLIT_SCHEDULES else None
        if times is not None and len(times) < len(WORK_KINDS):
            times = None
        return schedule_bubble(
            self.schedule,
            self.stages,
            self.micro_batches,
            virtual_stages=self.virtual_stages,
            times=times,
        )

    def steps(self, *, replica: int = 0) -> list[int]:
        """The optimizer steps that recorded any work on ``replica``, in order."""
        return sorted({e.step for e in self.events if e.replica == replica})

    def step_events(self, step: int, *, replica: int = 0) -> list[StageEvent]:
        """The work of one step on one replica; refuses a step that is absent or that some
        stage recorded nothing for, because a bubble measured without it would be wrong."""
        chosen = [e for e in self.events if e.step == step and e.replica == replica]
        if not chosen:
            recorded = self.steps(replica=replica)
            raise TimelineError(
                f"Replica {replica} recorded no work at step {step}; "
                f"the timeline has steps {compact_ranges(recorded) or 'none'} for it."
            )
        missing = sorted(set(range(self.stages)) - {e.stage for e in chosen})
        if missing:
            raise TimelineError(
                f"Step {step} of replica {replica} has no events for stage(s) "
                f"{', '.join(map(str, missing))}, so its bubble cannot be measured."
            )
        return chosen


# ---------------------------------------------------------------------------- reading


def read_timeline(path: str | Path) -> Timeline:
    """Parse and validate a timeline file; a malformed one is refused with one sentence
    naming the file and the line, rather than producing a plausible but wrong bubble."""
    path = Path(path)
    meta: dict[str, Any] | None = None
    meta_line = 0
    work: list[tuple[int, StageEvent]] = []
    peaks: list[tuple[int, dict[str, Any]]] = []
    readies: list[tuple[int, dict[str, Any]]] = []
    with path.open() as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            record = _parse_line(line, number, path)
            kind = record["kind"]
            if kind == "meta":
                if meta is not None and record != meta:
                    _fail(
                        path,
                        number,
                        f"has a second, different meta line (first on line {meta_line})",
                    )
                meta, meta_line = record, number
            elif kind == "activation_peak":
                peaks.append((number, record))
            elif kind == READY_KIND:
                readies.append((number, record))
            else:
                fields = {k: record[k] for k in _FIELDS[kind]}
                chunk = _chunk_of(record, number, path)
                work.append((number, StageEvent(kind=kind, chunk=chunk, **fields)))
    if meta is None:
        raise TimelineError(
            f'{path} has no meta line ({{"kind": "meta", "stages": ...}}), '
            "so it is not a complete pipeline timeline."
        )
    for name in ("stages", "micro_batches", "replicas"):
        if meta[name] < 1:
            _fail(path, meta_line, f"says {name} = {meta[name]}; it must be at least 1")
    if not isinstance(meta.get("flush", True), bool):
        flush = json.dumps(meta["flush"])
        _fail(path, meta_line, f"has flush = {flush}; expected true or false")
    for number, event in work:
        _check_place(path, number, meta, event.stage, event.replica, event.rank)
        if event.step < 0:
            _fail(path, number, f"has step {event.step}; steps count from 0")
        if not 0 <= event.micro < meta["micro_batches"]:
            _fail(
                path,
                number,
                f"names micro-batch {event.micro}, but the meta line says "
                f"there are {meta['micro_batches']} (0-{meta['micro_batches'] - 1})",
            )
        if event.chunk >= meta.get("virtual_stages", 1):
            _fail(
                path,
                number,
                f"names chunk {event.chunk}, but the meta line says there are "
                f"{meta.get('virtual_stages', 1)} virtual stage(s) per stage",
            )
        if event.end < event.start:
            _fail(path, number, f"ends before it starts (start {event.start}, end {event.end})")
    activation_peaks: dict[tuple[int, int], int] = {}
    for number, record in peaks:
        _check_place(path, number, meta, record["stage"], record["replica"], record["rank"])
        if record["bytes"] < 0:
            _fail(path, number, f"has a negative activation peak ({record['bytes']} bytes)")
        key = (record["replica"], record["stage"])
        activation_peaks[key] = max(activation_peaks.get(key, 0), record["bytes"])
    ready: dict[tuple[int, int, int], float] = {}
    for number, record in readies:
        _check_place(path, number, meta, record["stage"], record["replica"], record["rank"])
        key = (record["replica"], record["stage"], record["step"])
        ready[key] = min(ready.get(key, math.inf), record["start"])  # the step's first round
    events = [e for _, e in work]
    return Timeline(meta=meta, events=events, activation_peaks=activation_peaks, ready=ready)


def _parse_line(line: str, number: int, path: Path) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        _fail(path, number, f"is not valid JSON ({error.msg} at column {error.colno})")
    if not isinstance(record, dict):
        _fail(path, number, f"is a JSON {type(record).__name__}, not an object")
    kind = record.get("kind")
    if not isinstance(kind, str) or kind not in _FIELDS:
        _fail(path, number, f"has kind {json.dumps(kind)}; expected one of {', '.join(_FIELDS)}")
    for name, expected in _FIELDS[kind].items():
        if name not in record:
            _fail(path, number, f"lacks the field {name!r} that a {kind} record needs")
        value = record[name]
        if expected is float:
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            ok = ok and math.isfinite(value)
        else:
            ok = isinstance(value, expected) and not isinstance(value, bool)
        if not ok:
            wanted = {int: "an integer", float: "a finite number", str: "a string"}[expected]
            _fail(path, number, f"has {name} = {json.dumps(value)}; expected {wanted}")
    return record


def _chunk_of(record: dict[str, Any], number: int, path: Path) -> int:
    """The optional ``chunk`` field (written by interleaved schedules only)."""
    chunk = record.get("chunk", 0)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
        _fail(path, number, f"has chunk = {json.dumps(chunk)}; expected an integer >= 0")
    return chunk


def _check_place(
    path: Path, number: int, meta: dict[str, Any], stage: int, replica: int, rank: int
) -> None:
    if not 0 <= stage < meta["stages"]:
        _fail(
            path,
            number,
            f"names stage {stage}, but the meta line says there are "
            f"{meta['stages']} (0-{meta['stages'] - 1})",
        )
    if not 0 <= replica < meta["replicas"]:
        _fail(
            path,
            number,
            f"names replica {replica}, but the meta line says there are "
            f"{meta['replicas']} (0-{meta['replicas'] - 1})",
        )
    if rank < 0:
        _fail(path, number, f"has a negative rank ({rank})")


def _fail(path: Path, number: int, problem: str) -> NoReturn:
    raise TimelineError(f"Line {number} of {path} {problem}.")


# ---------------------------------------------------------------------------- bubble


def theoretical_bubble(stages: int, micro_batches: int) -> float:
    """The idle fraction of an ideal synchronous pipeline, ``(p - 1) / (m + p - 1)``.

    It holds for GPipe and 1F1B alike when every stage takes the same time per
    micro-batch (forward and backward may differ) and sending costs nothing.
    """
    if stages < 1 or micro_batches < 1:
        raise ValueError(
            f"A pipeline needs at least 1 stage and 1 micro-batch, not {stages} and "
            f"{micro_batches}."
        )
    return (stages - 1) / (micro_batches + stages - 1)


def schedule_bubble(
    schedule: str,
    stages: int,
    micro_batches: int,
    *,
    virtual_stages: int = 1,
    times: dict[str, float] | None = None,
) -> tuple[float, str]:
    """The theoretical bubble of ``schedule`` and its formula, for equal stages.

    GPipe and 1F1B: ``(p-1)/(m+p-1)``; interleaved 1F1B with ``v`` chunks per stage divides
    the idle ticks by ``v``: ``(p-1)/(vm+p-1)``. ZB-H1 (Qi et al. 2023) idles
    ``(p-1)(F+B-W)`` per stage against ``m(F+B+W)`` of work, with ``F``, ``B``, ``W`` the
    mean forward, input-gradient and weight-gradient times (``times``: ``forward``,
    ``backward``, ``weight``; equal thirds where not given). ZB-H2 has no closed form once
    a step ends in a flush: its own action lists are replayed by ``simulated_bubble`` on a
    clock of those times (``timed_bubble``)."""
    p, m, v = stages, micro_batches, virtual_stages
    if schedule == "zb-h2":
        equal = {"forward": 1.0, "backward": 1.0, "weight": 1.0}
        return timed_bubble(zb_h2(p, m), times or equal), "simulated on its lists with F, B, W"
    if schedule == "zb-h1":
        t = times or {"forward": 1.0, "backward": 1.0, "weight": 1.0}
        f, b, w = t["forward"], t["backward"], t["weight"]
        idle = (p - 1) * max(f + b - w, 0.0)
        work = m * (f + b + w)
        return (idle / (work + idle) if work + idle > 0 else 0.0), "(p-1)(F+B-W)/(m(F+B+W)+...)"
    if v > 1:
        return (p - 1) / (v * m + p - 1), "(p-1)/(vm+p-1)"
    return theoretical_bubble(p, m), "(p-1)/(m+p-1)"


def measured_bubble(timeline: Timeline, *, step: int | None = None, replica: int = 0) -> float:
    """The fraction of a step that the stages of one replica spent idle.

    Definition: the step's *span* runs from the earliest start to the latest end of that
    step's forwards and backwards on ``replica``, over all its stages. A stage's *busy*
    time is the total duration of its own events (overlaps, which one worker never
    produces, count once); its *idle* time is ``span - busy``. The bubble is the mean over
    stages of ``idle / span``. So it counts only compute: the optimizer update and any
    gradient all-reduce after the last backward fall outside the span. With ``step=None``
    the result is the median over all recorded steps but the first, which pays for
    warm-up (allocation, autotuning, first-touch communication); a single recorded step
    is used as it is. The median is the lower middle one of an even count, so that it is
    one step's bubble: the step ``median_step`` names, which the report draws.
    """
    if step is not None:
        return bubble_of(*step_profile(timeline, step, replica))
    return median_step(timeline, replica)[1]


def median_step(timeline: Timeline, replica: int = 0) -> tuple[int, float]:
    """``(step, bubble)`` of the step whose bubble is the median over the measured steps
    (the lower middle one of an even count; the earliest such step on a tie)."""
    steps = measured_steps(timeline, replica)
    bubbles = [(bubble_of(*step_profile(timeline, s, replica)), s) for s in steps]
    bubble, step = sorted(bubbles)[(len(bubbles) - 1) // 2]
    return step, bubble


def measured_steps(timeline: Timeline, replica: int) -> list[int]:
    steps = timeline.steps(replica=replica)
    if not steps:
        raise TimelineError(
            f"The timeline has no forward or backward events for replica {replica}."
        )
    return steps[1:] if len(steps) > 1 else steps


def step_profile(timeline: Timeline, step: int, replica: int) -> tuple[float, dict[int, float]]:
    """``(span, busy seconds per stage)`` of one step on one replica."""
    events = timeline.step_events(step, replica=replica)
    span = max(e.end for e in events) - min(e.start for e in events)
    if span <= 0:
        raise TimelineError(f"Step {step} of replica {replica} spans no time, so it has no bubble.")
    busy = {
        stage: covered_seconds([(e.start, e.end) for e in events if e.stage == stage])
        for stage in range(timeline.stages)
    }
    return span, busy


def covered_seconds(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by ``(start, end)`` intervals, overlaps counted once (a stage's
    passes of several chunks may overlap by a stamp's width)."""
    total, reached = 0.0, -math.inf
    for start, end in sorted(intervals):
        start = max(start, reached)
        if end > start:
            total += end - start
            reached = end
    return total


def bubble_of(span: float, busy: dict[int, float]) -> float:
    return statistics.fmean((span - b) / span for b in busy.values())


# ---------------------------------------------------------------------------- trace


def chrome_trace(timeline: Timeline) -> dict[str, Any]:
    """The timeline as Trace Event Format JSON, for chrome://tracing and ui.perfetto.dev.

    One complete ("X") event per forward ("F3") or backward ("B3"), timestamps in
    microseconds from the first event; a process per replica and a thread per stage, named
    by metadata events so the rows read "stage 0", "stage 1", ... in stage order.
    """
    t0 = min((e.start for e in timeline.events), default=0.0)
    trace: list[dict[str, Any]] = []
    for replica in range(timeline.replicas):
        trace.append(_metadata("process_name", replica, 0, name=f"pipeline replica {replica}"))
        trace.append(_metadata("process_sort_index", replica, 0, sort_index=replica))
        for stage in range(timeline.stages):
            trace.append(_metadata("thread_name", replica, stage, name=f"stage {stage}"))
            trace.append(_metadata("thread_sort_index", replica, stage, sort_index=stage))
    for event in sorted(timeline.events, key=lambda e: (e.start, e.replica, e.stage)):
        trace.append(
            {
                "name": f"{event.kind[0].upper()}{event.micro}",
                "cat": event.kind,
                "ph": "X",
                "ts": round((event.start - t0) * 1e6, 3),
                "dur": round(event.duration * 1e6, 3),
                "pid": event.replica,
                "tid": event.stage,
                "args": {"step": event.step, "micro": event.micro, "rank": event.rank},
            }
        )
    other = {k: timeline.meta[k] for k in ("schedule", "stages", "micro_batches", "replicas")}
    return {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": other}


def _metadata(event: str, pid: int, tid: int, **args: Any) -> dict[str, Any]:
    return {"name": event, "ph": "M", "pid": pid, "tid": tid, "args": args}


def write_chrome_trace(timeline: Timeline, path: str | Path) -> Path:
    """Write :func:`chrome_trace` to ``path`` (open it in ui.perfetto.dev)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(timeline)) + "\n")
    return path


# ---------------------------------------------------------------------------- picture


def compact_ranges(numbers: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``: step lists stay short in messages."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
