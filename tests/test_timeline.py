"""Pipeline timelines: parsing, the bubble against hand-computed values, trace, picture, report.

Timelines are built by hand with a tiny scheduler (each stage runs its operations in the
given order, each as soon as its input is ready), so the expected bubbles can be worked out
on paper and written literally.

Tolerances: a bubble is a float64 ratio of sums of a few dozen durations that are whole
or half units, exact in binary, so only the final divisions and the float64 sums of
``time.perf_counter``-like offsets round: a handful of roundings of 2^-53 (1.1e-16), at
most ~1e-15. ``abs=1e-12`` leaves a thousandfold margin and is far below the smallest
change a scheduling error makes (one unit of idle in a span of at most 30: 0.03).
``pytest.approx``'s default (rel 1e-6) on the theoretical bubble and the trace's
microseconds holds for the same reason.
"""

from __future__ import annotations

import json
import re
import struct
import sys
from pathlib import Path

import pytest

from paratrain.parallel.pipeline.timeline import (
    StageEvent,
    TimelineError,
    chrome_trace,
    measured_bubble,
    median_step,
    read_timeline,
    theoretical_bubble,
    write_chrome_trace,
)
from paratrain.parallel.pipeline.timeline_report import (
    draw_timeline,
    report,
    summarize,
    timeline_title,
)


def gpipe_order(stages: int, micro: int) -> list[list[tuple[str, int]]]:
    """All forwards, then all backwards, on every stage."""
    order = [("forward", i) for i in range(micro)] + [("backward", i) for i in range(micro)]
    return [list(order) for _ in range(stages)]


def one_f_one_b_order(stages: int, micro: int) -> list[list[tuple[str, int]]]:
    """Warm-up forwards, then alternate one forward and one backward, then drain."""
    orders = []
    for stage in range(stages):
        warmup = min(stages - stage - 1, micro)
        ops = [("forward", i) for i in range(warmup)]
        for i in range(micro - warmup):
            ops += [("forward", warmup + i), ("backward", i)]
        ops += [("backward", i) for i in range(micro - warmup, micro)]
        orders.append(ops)
    return orders


def simulate(orders, *, forward=1.0, backward=1.0, t0=100.0, step=0, replica=0) -> list[dict]:
    """Event records for one step: ``forward``/``backward`` are durations, one number for all
    stages or a list per stage."""
    stages = len(orders)
    fwd = forward if isinstance(forward, list) else [forward] * stages
    bwd = backward if isinstance(backward, list) else [backward] * stages
    done: dict[tuple[str, int, int], float] = {}
    free = [t0] * stages
    position = [0] * stages
    records = []
    while any(position[s] < len(orders[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            if position[s] == len(orders[s]):
                continue
            kind, i = orders[s][position[s]]
            if kind == "forward":
                need = [("forward", s - 1, i)] if s > 0 else []
            else:
                need = [("backward", s + 1, i)] if s < stages - 1 else [("forward", s, i)]
            if not all(k in done for k in need):
                continue
            start = max([free[s]] + [done[k] for k in need])
            end = start + (fwd[s] if kind == "forward" else bwd[s])
            done[(kind, s, i)] = free[s] = end
            position[s] += 1
            progressed = True
            records.append(
                {
                    "rank": replica * stages + s,
                    "stage": s,
                    "replica": replica,
                    "step": step,
                    "kind": kind,
                    "micro": i,
                    "start": start,
                    "end": end,
                }
            )
        assert progressed, "the order deadlocks"
    return records


def meta(stages, micro, *, schedule="gpipe", replicas=1) -> dict:
    return {
        "kind": "meta",
        "stages": stages,
        "micro_batches": micro,
        "schedule": schedule,
        "replicas": replicas,
    }


def write(path: Path, records) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def timeline_of(tmp_path, records):
    return read_timeline(write(tmp_path / "timeline.jsonl", records))


# ------------------------------------------------------------------------------ bubble


def test_theoretical_bubble():
    assert theoretical_bubble(2, 4) == pytest.approx(1 / 5)
    assert theoretical_bubble(4, 8) == pytest.approx(3 / 11)
    assert theoretical_bubble(1, 8) == 0.0
    with pytest.raises(ValueError, match="at least 1 stage"):
        theoretical_bubble(0, 4)


def test_ideal_gpipe_2x4_measures_the_theory(tmp_path):
    # Stage 0: F0-F3 at 0-4, B0-B3 at 6-10; stage 1: F at 1-5, B at 5-9. Span 10, busy 8
    # on each stage -> idle 2/10 on each -> 0.2 = (2-1)/(4+2-1).
    timeline = timeline_of(tmp_path, [meta(2, 4), *simulate(gpipe_order(2, 4))])
    assert measured_bubble(timeline) == pytest.approx(0.2, abs=1e-12)


def test_backward_twice_as_long_still_measures_the_theory(tmp_path):
    # Forward phase spans 5 x 1, backward phase 5 x 2: span 15, busy 4 + 8 = 12 -> 3/15.
    records = simulate(gpipe_order(2, 4), forward=1.0, backward=2.0)
    timeline = timeline_of(tmp_path, [meta(2, 4), *records])
    assert measured_bubble(timeline) == pytest.approx(0.2, abs=1e-12)


def test_ideal_1f1b_4x8_measures_the_theory(tmp_path):
    # Span 2 x (8 + 4 - 1) = 22, each stage busy 16 -> 6/22 = 3/11.
    records = simulate(one_f_one_b_order(4, 8))
    timeline = timeline_of(tmp_path, [meta(4, 8, schedule="1f1b"), *records])
    assert measured_bubble(timeline) == pytest.approx(3 / 11, abs=1e-12)


def test_a_slow_stage_shows_a_bubble_above_theory(tmp_path):
    # 2 stages x 2 micro, stage 1 twice as slow. Stage 0: F 0-2, B0 7-8, B1 9-10 (busy 4);
    # stage 1: F0 1-3, F1 3-5, B0 5-7, B1 7-9 (busy 8). Span 10 -> (0.6 + 0.2) / 2 = 0.4.
    records = simulate(gpipe_order(2, 2), forward=[1.0, 2.0], backward=[1.0, 2.0])
    timeline = timeline_of(tmp_path, [meta(2, 2), *records])
    assert measured_bubble(timeline) == pytest.approx(0.4, abs=1e-12)
    assert theoretical_bubble(2, 2) == pytest.approx(1 / 3)


def slow(step, t0):
    return simulate(gpipe_order(2, 2), forward=[1.0, 2.0], backward=[1.0, 2.0], step=step, t0=t0)


def ideal(step, t0):
    return simulate(gpipe_order(2, 2), step=step, t0=t0)


def test_default_is_the_median_over_steps_after_warm_up(tmp_path):
    # Ideal 2x2 GPipe: span 6, busy 4 -> 1/3. Steps: 0 slow (0.4, warm-up), 1 and 2 ideal
    # (1/3), 3 slow (0.4). Median of steps 1-3 is 1/3; with step 0 it would be 11/30.
    records = [meta(2, 2), *slow(0, 0.0), *ideal(1, 20.0), *ideal(2, 40.0), *slow(3, 60.0)]
    timeline = timeline_of(tmp_path, records)
    assert measured_bubble(timeline) == pytest.approx(1 / 3, abs=1e-12)
    assert measured_bubble(timeline, step=0) == pytest.approx(0.4, abs=1e-12)
    assert measured_bubble(timeline, step=3) == pytest.approx(0.4, abs=1e-12)
    assert timeline.steps() == [0, 1, 2, 3]


def test_replicas_are_measured_apart(tmp_path):
    records = [
        meta(2, 2, replicas=2),
        *simulate(gpipe_order(2, 2), replica=0),
        *simulate(gpipe_order(2, 2), forward=[1.0, 2.0], backward=[1.0, 2.0], replica=1),
    ]
    timeline = timeline_of(tmp_path, records)
    assert measured_bubble(timeline, replica=0) == pytest.approx(1 / 3, abs=1e-12)
    assert measured_bubble(timeline, replica=1) == pytest.approx(0.4, abs=1e-12)


def test_gradient_accumulation_rounds_share_a_step(tmp_path):
    # Two rounds of ideal 2x2 GPipe in one step, back to back (the trainer numbers the
    # micro-batches of each round from 0): span 12, busy 8 per stage -> 1/3, as one round.
    first = simulate(gpipe_order(2, 2))
    second = simulate(gpipe_order(2, 2), t0=106.0)
    timeline = timeline_of(tmp_path, [meta(2, 2), *first, *second])
    assert len(timeline.events) == 16
    assert measured_bubble(timeline) == pytest.approx(1 / 3, abs=1e-12)


def test_missing_step_or_stage_is_refused(tmp_path):
    records = [r for r in simulate(gpipe_order(2, 2)) if r["stage"] == 0]
    timeline = timeline_of(tmp_path, [meta(2, 2), *records])
    with pytest.raises(TimelineError, match=r"no events for stage\(s\) 1"):
        measured_bubble(timeline)
    with pytest.raises(TimelineError, match="no work at step 7; the timeline has steps 0"):
        measured_bubble(timeline, step=7)


# ------------------------------------------------------------------------------ reading


def test_read_timeline_keeps_events_and_peaks(tmp_path):
    records = [
        meta(2, 2),
        *simulate(gpipe_order(2, 2)),
        {"kind": "activation_peak", "rank": 0, "stage": 0, "replica": 0, "bytes": 2048},
        {"kind": "activation_peak", "rank": 1, "stage": 1, "replica": 0, "bytes": 1024},
    ]
    timeline = timeline_of(tmp_path, records)
    assert timeline.meta == meta(2, 2)
    assert (timeline.stages, timeline.micro_batches, timeline.schedule) == (2, 2, "gpipe")
    assert len(timeline.events) == 8
    first = timeline.events[0]
    assert first == StageEvent(
        rank=0, stage=0, replica=0, step=0, kind="forward", micro=0, start=100.0, end=101.0
    )
    assert first.duration == 1.0
    assert timeline.activation_peaks == {(0, 0): 2048, (0, 1): 1024}
    assert timeline.ready == {} and timeline.flush  # an older file: neither said


READY = {"kind": "ready", "rank": 1, "stage": 1, "replica": 0, "step": 3, "start": 5.0}


def test_read_timeline_keeps_when_each_stage_began_each_step(tmp_path):
    """Each stage's ``ready`` record of a step's first round (a later round's is later):
    when it was free of the previous step's work; the meta line's ``flush`` says whether
    steps ended together."""
    records = [
        {**meta(2, 2), "flush": False},
        *simulate(gpipe_order(2, 2)),
        READY,
        {**READY, "start": 7.0},
        {**READY, "stage": 0, "rank": 0, "start": 4.5},
    ]
    timeline = timeline_of(tmp_path, records)
    assert timeline.ready == {(0, 1, 3): 5.0, (0, 0, 3): 4.5}
    assert not timeline.flush


EVENT = {
    "rank": 0,
    "stage": 0,
    "replica": 0,
    "step": 0,
    "kind": "forward",
    "micro": 0,
    "start": 1.0,
    "end": 2.0,
}


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"kind": "forward", ', "is not valid JSON"),
        ("[1, 2]", "is a JSON list, not an object"),
        (json.dumps({**EVENT, "kind": "send"}), 'has kind "send"; expected one of'),
        (json.dumps({**EVENT, "kind": ["forward"]}), 'has kind ["forward"]; expected one of'),
        (json.dumps({k: v for k, v in EVENT.items() if k != "micro"}), "lacks the field 'micro'"),
        (json.dumps({**EVENT, "stage": True}), "has stage = true; expected an integer"),
        (json.dumps({**EVENT, "start": "1.0"}), 'has start = "1.0"; expected a finite number'),
        (json.dumps({**EVENT, "end": 0.5}), "ends before it starts"),
        (json.dumps({**EVENT, "stage": 2}), "names stage 2, but the meta line says there are 2"),
        (json.dumps({**EVENT, "micro": 4}), "names micro-batch 4"),
        (json.dumps({**EVENT, "replica": 1}), "names replica 1"),
        (json.dumps({**meta(2, 4), "stages": 3}), "has a second, different meta line"),
        (json.dumps({**READY, "stage": 2}), "names stage 2, but the meta line says there are 2"),
        (json.dumps({**READY, "start": None}), "has start = null; expected a finite number"),
    ],
)
def test_malformed_lines_are_refused_naming_file_and_line(tmp_path, line, message):
    path = tmp_path / "timeline.jsonl"
    path.write_text(json.dumps(meta(2, 4)) + "\n" + json.dumps(EVENT) + "\n\n" + line + "\n")
    with pytest.raises(TimelineError) as caught:
        read_timeline(path)
    text = str(caught.value)
    assert text.startswith(f"Line 4 of {path} ")
    assert message in text
    assert text.endswith(".") and "\n" not in text


def test_a_meta_line_whose_flush_is_no_boolean_is_refused(tmp_path):
    path = tmp_path / "timeline.jsonl"
    path.write_text(json.dumps({**meta(2, 4), "flush": "false"}) + "\n")
    with pytest.raises(TimelineError, match='Line 1 of .* has flush = "false"; expected true'):
        read_timeline(path)


def test_a_file_without_meta_is_refused(tmp_path):
    path = write(tmp_path / "timeline.jsonl", [EVENT])
    with pytest.raises(TimelineError, match="has no meta line"):
        read_timeline(path)


# ------------------------------------------------------------------------------ trace


def test_chrome_trace_structure(tmp_path):
    records = [meta(2, 4), *simulate(gpipe_order(2, 4), forward=0.001, backward=0.002)]
    timeline = timeline_of(tmp_path, records)
    trace = json.loads(json.dumps(chrome_trace(timeline)))
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == 16
    for event in complete:
        assert set(event) >= {"name", "cat", "ph", "ts", "dur", "pid", "tid"}
        assert event["pid"] == 0 and event["tid"] in (0, 1)
        assert event["name"] == ("F" if event["cat"] == "forward" else "B") + str(
            event["args"]["micro"]
        )
    assert min(e["ts"] for e in complete) == 0
    f3 = next(e for e in complete if e["name"] == "F3" and e["tid"] == 1)
    assert f3["ts"] == pytest.approx(4000.0) and f3["dur"] == pytest.approx(1000.0)
    b0 = next(e for e in complete if e["name"] == "B0" and e["tid"] == 1)
    assert b0["ts"] == pytest.approx(5000.0) and b0["dur"] == pytest.approx(2000.0)
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {(0, 0): "stage 0", (0, 1): "stage 1"}
    assert any(e["name"] == "process_name" for e in events)
    assert all(e["ph"] in ("X", "M") for e in events)

    path = write_chrome_trace(timeline, tmp_path / "out" / "trace.json")
    assert json.loads(path.read_text()) == trace


# ------------------------------------------------------------------------------ picture


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_draw_timeline_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    records = [
        meta(4, 8, schedule="1f1b"),
        *simulate(one_f_one_b_order(4, 8), forward=0.002, backward=0.004),
    ]
    timeline = timeline_of(tmp_path, records)
    path = draw_timeline(timeline, tmp_path / "pic" / "timeline.png")
    width, height = png_size(path)
    assert 1000 <= width <= 2000 and 250 <= height <= 1000
    assert path.stat().st_size > 10_000


def test_drawing_without_matplotlib_says_what_to_install(tmp_path, monkeypatch):
    timeline = timeline_of(tmp_path, [meta(2, 2), *simulate(gpipe_order(2, 2))])
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(RuntimeError, match=r'pip install "paratrain\[report\]"'):
        draw_timeline(timeline, tmp_path / "timeline.png")


# ------------------------------------------------------------------------------ report


def pipeline_run(tmp_path) -> Path:
    # 2 stages x 4 micro-batches, 1 ms forward, 1 ms backward: busy 8 ms of a 10 ms span.
    records = [{**meta(2, 4, schedule="1f1b"), "balance": [3, 2], "recompute": False}]
    records[0]["flush"] = False
    for step in range(3):
        records += simulate(
            one_f_one_b_order(2, 4), forward=0.001, backward=0.001, step=step, t0=step * 1.0
        )
    records.append(
        {"kind": "activation_peak", "rank": 0, "stage": 0, "replica": 0, "bytes": 13_107_200}
    )
    write(tmp_path / "run" / "timeline.jsonl", records)
    return tmp_path / "run"


def test_summarize_reports_the_numbers(tmp_path):
    text = summarize(pipeline_run(tmp_path))
    assert "schedule            1f1b" in text
    assert "stages              2" in text
    assert "micro-batches       4" in text
    assert "theoretical bubble  20.0%" in text
    assert (
        "measured bubble     20.0%  (median over steps 1-2; the first recorded is left out" in text
    )
    assert "measured/theory     1.00" in text
    own = next(line for line in text.splitlines() if "on its own passes" in line)
    assert (
        "20.0% (this schedule replayed on each step's own passes; measured/that 1.00, step by step)"
        in own
    )
    assert "steps recorded      3 (0-2)" in text
    assert "balance             [3, 2]\n  recompute           False" in text
    assert "step lists          steps back to back\n" in text
    rows = [line.split() for line in text.splitlines() if line.strip()[:1].isdigit()]
    assert rows == [
        ["0", "8.000", "20%", "1.000", "1.000", "12.5", "MiB"],
        ["1", "8.000", "20%", "1.000", "1.000", "-"],
    ]


def test_report_writes_trace_and_picture(tmp_path):
    pytest.importorskip("matplotlib")
    run = pipeline_run(tmp_path)
    paths = report(run)
    assert paths == {"trace": run / "trace.json", "timeline": run / "timeline.png"}
    assert json.loads(paths["trace"].read_text())["traceEvents"]
    png_size(paths["timeline"])
    elsewhere = report(run, out_dir=tmp_path / "elsewhere")
    assert all(p.parent == tmp_path / "elsewhere" and p.is_file() for p in elsewhere.values())


def test_a_run_without_timeline_is_not_a_pipeline_run(tmp_path):
    (tmp_path / "run").mkdir()
    with pytest.raises(TimelineError, match="not a pipeline run, or it recorded no timeline"):
        summarize(tmp_path / "run")
    with pytest.raises(TimelineError, match="not a pipeline run"):
        report(tmp_path / "run")


def test_summarize_lists_each_replica(tmp_path):
    records = [meta(2, 2, replicas=2)]
    for step in range(2):
        records += ideal(step, step * 10.0)
        records += simulate(
            gpipe_order(2, 2),
            forward=[1.0, 2.0],
            backward=[1.0, 2.0],
            step=step,
            t0=step * 10.0,
            replica=1,
        )
    write(tmp_path / "run" / "timeline.jsonl", records)
    text = summarize(tmp_path / "run")
    assert "replicas            2" in text
    assert "theoretical bubble  33.3%" in text
    assert "  replica 0:\n    steps recorded    2 (0-1)\n    measured bubble   33.3%" in text
    assert "  replica 1:\n    steps recorded    2 (0-1)\n    measured bubble   40.0%" in text
    assert "    measured/theory   1.20" in text
    # replica 1's stages are unequal (the second takes twice as long): the textbook bubble
    # misses that, the replay on its own passes does not
    own = [line for line in text.splitlines() if "on its own passes" in line]
    assert "40.0%" in own[1] and "measured/that 1.00" in own[1]


# ------------------------------------------------------------------ picture agrees with text


def uneven_run(tmp_path, replicas=1) -> Path:
    # Steps 1-4 after the warm-up step 0, bubbles 1/3 (ideal), 0.4 (slow), 1/3, 0.4: an even
    # count, whose lower middle is 1/3, at step 1 or 3 (equal but for rounding). The plain
    # median would be 11/30, which no step has, so no picture could show it.
    records = [meta(2, 2, replicas=replicas)]
    for replica in range(replicas):
        for step, shape in enumerate((slow, ideal, slow, ideal, slow)):
            records += [{**r, "replica": replica} for r in shape(step, 20.0 * step)]
    write(tmp_path / "run" / "timeline.jsonl", records)
    return tmp_path / "run"


def test_the_drawn_step_is_the_one_whose_bubble_the_text_reports(tmp_path):
    run = uneven_run(tmp_path)
    timeline = read_timeline(run / "timeline.jsonl")
    text = summarize(run)
    assert "measured bubble     33.3%" in text
    drawn = int(re.search(r"drawn step +(\d+) \(its bubble is the median", text).group(1))
    assert drawn in (1, 3)
    title = timeline_title(timeline, drawn, 0)
    assert f"(step {drawn}, the median step by bubble)" in title
    assert "bubble measured 33.3% vs theoretical" in title
    assert measured_bubble(timeline) == measured_bubble(timeline, step=drawn)
    assert "a chosen step" in timeline_title(timeline, 2, 0)


def test_every_replica_of_a_hybrid_run_is_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    one = draw_timeline(
        read_timeline(uneven_run(tmp_path / "one") / "timeline.jsonl"), tmp_path / "1.png"
    )
    two_run = uneven_run(tmp_path / "two", replicas=2)
    two = draw_timeline(read_timeline(two_run / "timeline.jsonl"), tmp_path / "2.png")
    # A panel per replica: the picture grows by one panel's height (1.2 + 0.45 x 2 stages
    # inches at 120 dpi = 252 px).
    assert png_size(two)[1] - png_size(one)[1] == pytest.approx(252, abs=2)
    timeline = read_timeline(two_run / "timeline.jsonl")
    drawn, _ = median_step(timeline, 1)
    assert f"(step {drawn}, replica 1 of 2, the median step by bubble)" in timeline_title(
        timeline, drawn, 1
    )
    assert summarize(two_run).count("drawn step") == 2
