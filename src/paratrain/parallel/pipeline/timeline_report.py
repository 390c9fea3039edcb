"""Pictures and text for a pipeline run: ``paratrain report RUN_DIR``.

Draws the median step of each replica's recorded timeline (a row per stage, forward and
backward coloured, idle time left empty so the bubble shows), summarises the measured
bubble next to the theory, and writes the Chrome/Perfetto trace beside them. The reading
and measuring live in ``timeline``; this module only presents.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from paratrain.parallel.pipeline.replay import message_time, stepwise_ratios, stepwise_theory
from paratrain.parallel.pipeline.timeline import (
    WORK_KINDS,
    Timeline,
    TimelineError,
    bubble_of,
    compact_ranges,
    measured_steps,
    median_step,
    read_timeline,
    step_profile,
    write_chrome_trace,
)
from paratrain.parallel.strategy import TIMELINE_FILE

__all__ = ["draw_timeline", "report", "summarize", "timeline_title"]

_COLOURS = {"forward": "#4C8BD6", "backward": "#F28E2B", "weight": "#59A14F"}
"""Forward blue, backward (the input's gradient, where split) orange, W (weights) green."""
_MIB = 1 << 20
_SUMMARY_SKIPS = {"kind", "stages", "micro_batches", "schedule", "replicas"}


def draw_timeline(
    timeline: Timeline,
    path: str | Path,
    *,
    step: int | None = None,
    replica: int | None = None,
) -> Path:
    """Draw one step per replica as a PNG: a row per stage, forward and backward boxes
    labelled with their micro-batch, idle time left empty so the bubble shows.

    By default every replica is drawn (one panel each) at its median step, the step whose
    bubble is the one ``summarize`` reports (``median_step``), so picture and text agree;
    each panel's title names its step and replica. ``step``/``replica`` pick one.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as error:
        raise RuntimeError(
            'Drawing the pipeline timeline needs matplotlib: pip install "paratrain[report]".'
        ) from error
    replicas = range(timeline.replicas) if replica is None else [replica]
    chosen = [(r, step if step is not None else median_step(timeline, r)[0]) for r in replicas]
    panel_height = 1.2 + 0.45 * timeline.stages
    # Agg canvas on a bare Figure: no pyplot, so the caller's backend and figures stay as
    # they were.
    fig = Figure(figsize=(12, 0.5 + panel_height * len(chosen)), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(chosen), 1, squeeze=False)[:, 0]
    labelled = []
    for ax, (rep, drawn) in zip(axes, chosen, strict=True):
        labelled.append((ax, _draw_step(ax, timeline, drawn, rep)))
    kinds = [k for k in WORK_KINDS if any(e.kind == k for e in timeline.events)]
    names = {"backward": "backward (B)" if "weight" in kinds else "backward", "weight": "W"}
    axes[0].legend(
        handles=[
            *(Patch(color=_COLOURS[k], label=names.get(k, k)) for k in kinds),
            Patch(facecolor="white", edgecolor="0.6", label="idle"),
        ],
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),
        ncol=len(kinds) + 1,
        frameon=False,
        fontsize=9,
    )
    # Labels only where they fit: the pixel width of a box is known once laid out.
    fig.canvas.draw()
    for ax, (events, t0, span_ms) in labelled:
        px_per_ms = ax.get_window_extent().width / span_ms
        for event in events:
            label = str(event.micro)
            if event.duration * 1e3 * px_per_ms >= 8 * len(label) + 4:
                ax.text(
                    (event.start - t0 + event.duration / 2) * 1e3,
                    event.stage,
                    label,
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="#1a1a1a",
                    clip_on=True,
                )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def timeline_title(timeline: Timeline, step: int, replica: int) -> str:
    """A panel's title: the pipeline's shape, the step drawn and its bubble against theory."""
    theory, formula = timeline.theory(replica)
    median, _ = median_step(timeline, replica)
    which = "the median step by bubble" if step == median else "a chosen step"
    where = f", replica {replica} of {timeline.replicas}" if timeline.replicas > 1 else ""
    return (
        f"{timeline.schedule} pipeline: {timeline.stages} stages x {timeline.micro_batches} "
        f"micro-batches (step {step}{where}, {which})\nbubble measured "
        f"{bubble_of(*step_profile(timeline, step, replica)):.1%} vs theoretical "
        f"{formula} = {theory:.1%}"
    )


def _draw_step(ax, timeline: Timeline, step: int, replica: int):
    """One step of one replica on ``ax``; returns what the box labels need."""
    events = timeline.step_events(step, replica=replica)
    span, busy = step_profile(timeline, step, replica)
    t0 = min(e.start for e in events)
    stages, span_ms = timeline.stages, span * 1e3
    for stage in range(stages):
        for kind in WORK_KINDS:  # one collection per row and colour: fast for long runs
            boxes = [
                ((e.start - t0) * 1e3, e.duration * 1e3)
                for e in events
                if e.stage == stage and e.kind == kind
            ]
            ax.broken_barh(
                boxes,
                (stage - 0.4, 0.8),
                facecolors=_COLOURS[kind],
                edgecolors="white",
                linewidth=0.8,
            )
    ax.set_xlim(0, span_ms)
    ax.set_ylim(stages - 0.5, -0.5)
    ax.set_yticks(range(stages), [f"stage {s}" for s in range(stages)])
    ax.set_xlabel(f"time within step {step} (ms)")
    ax.grid(axis="x", color="0.9")
    ax.set_axisbelow(True)
    for s in range(stages):
        ax.text(
            1.005,
            s,
            f"idle {(span - busy[s]) / span:.0%}",
            va="center",
            fontsize=8,
            color="0.35",
            transform=ax.get_yaxis_transform(),
        )
    ax.set_title(timeline_title(timeline, step, replica), loc="left", fontsize=10)
    return events, t0, span_ms


# ---------------------------------------------------------------------------- report


def summarize(run_dir: str | Path) -> str:
    """The text ``paratrain report RUN_DIR`` prints for a pipeline run: the shape of the
    pipeline, the bubble measured against theory, and where each stage spent its step."""
    run_dir = Path(run_dir)
    timeline = read_timeline(_timeline_path(run_dir))
    p, m = timeline.stages, timeline.micro_batches
    theory, formula = timeline.theory()
    lines = [
        f"paratrain report {run_dir}: pipeline timeline",
        _field("  ", "schedule", timeline.schedule),
        _field("  ", "stages", p),
        _field("  ", "micro-batches", m),
        _field("  ", "replicas", timeline.replicas),
        *(_meta_field(k, v) for k, v in timeline.meta.items() if k not in _SUMMARY_SKIPS),
        _field("  ", "theoretical bubble", f"{theory:.1%}  = {formula}"),
    ]
    for replica in range(timeline.replicas):
        if not timeline.steps(replica=replica):
            lines.append(f"  replica {replica}: no forward or backward events recorded")
            continue
        lines += _replica_summary(timeline, replica, theory)
    return "\n".join(lines)


def _own_passes(timeline: Timeline, replica: int) -> str:
    """The bubble the schedule must have with this run's own pass times, each step
    replayed on them (``replay.stepwise_theory``): what the run idles beyond it is the
    engine's gaps between passes, not the schedule or uneven stages; measured over it
    step by step, each step against its own replay (``replay.stepwise_ratios``)."""
    try:
        hop = message_time(timeline, replica)  # read off every event: once for both
        own = stepwise_theory(timeline, replica, hop_s=hop)
        ratios = stepwise_ratios(timeline, replica, hop_s=hop)
    except TimelineError as error:
        return f"n/a ({error})"
    ratio = f"measured/that {statistics.median(ratios):.2f}" if ratios else "no bubble"
    return f"{own:.1%} (this schedule replayed on each step's own passes; {ratio}, step by step)"


def _replica_summary(timeline: Timeline, replica: int, theory: float) -> list[str]:
    all_steps = timeline.steps(replica=replica)
    steps = measured_steps(timeline, replica)
    profiles = [step_profile(timeline, s, replica) for s in steps]
    drawn, measured = median_step(timeline, replica)
    ratio = f"{measured / theory:.2f}" if theory > 0 else "n/a (one stage has no bubble)"
    if len(all_steps) > 1:
        over = (
            f"median over steps {compact_ranges(steps)}; the first recorded is left out as warm-up"
        )
    else:
        over = f"the only recorded step, {steps[0]}"
    indent = "  " if timeline.replicas == 1 else "    "
    lines = [] if timeline.replicas == 1 else [f"  replica {replica}:"]
    lines += [
        _field(indent, "steps recorded", f"{len(all_steps)} ({compact_ranges(all_steps)})"),
        _field(indent, "measured bubble", f"{measured:.1%}  ({over})"),
        _field(indent, "measured/theory", ratio),
        _field(indent, "on its own passes", _own_passes(timeline, replica)),
        _field(indent, "drawn step", f"{drawn} (its bubble is the median; timeline.png)"),
    ]
    peaks = {s: b for (r, s), b in timeline.activation_peaks.items() if r == replica}
    split = any(e.kind == "weight" for e in timeline.events)
    header = f"{indent}  stage   busy ms/step   idle   fwd ms/micro   bwd ms/micro"
    header += "     W ms/micro" if split else ""
    lines += [
        f"{indent}per stage (medians over the same steps):",
        header + ("   activation peak" if peaks else ""),
    ]
    chosen = set(steps)
    for stage in range(timeline.stages):
        busy = statistics.median(b[stage] for _, b in profiles) * 1e3
        idle = statistics.median((span - b[stage]) / span for span, b in profiles)
        mean_ms = {}
        for kind in WORK_KINDS:
            durations = [
                e.duration
                for e in timeline.events
                if e.replica == replica and e.stage == stage and e.kind == kind and e.step in chosen
            ]
            mean_ms[kind] = statistics.fmean(durations) * 1e3 if durations else math.nan
        row = (
            f"{indent}  {stage:>5}   {busy:>12.3f}   {idle:>4.0%}   "
            f"{mean_ms['forward']:>12.3f}   {mean_ms['backward']:>12.3f}"
        )
        row += f"   {mean_ms['weight']:>12.3f}" if split else ""
        if peaks:
            peak = f"{peaks[stage] / _MIB:.1f} MiB" if stage in peaks else "-"
            row += f"   {peak:>15}"
        lines.append(row)
    return lines


def _meta_field(key: str, value: object) -> str:
    """A meta line's field as the summary says it; ``flush`` in words."""
    if key == "flush":
        flushed = "flushed (clipping, fp16, a tie across stages or a tensor split)"
        return _field("  ", "step lists", flushed if value else "steps back to back")
    return _field("  ", key, value)


def _field(indent: str, label: str, value: object) -> str:
    """One ``label  value`` line, values aligned whatever the indent."""
    return f"{indent}{label:<{22 - len(indent)}}{value}"


def report(run_dir: str | Path, *, out_dir: str | Path | None = None) -> dict[str, Path]:
    """Write ``trace.json`` and ``timeline.png`` for a pipeline run into ``out_dir`` (default:
    the run dir) and return their paths. The trace is written first, so it exists even
    when matplotlib is missing and drawing raises."""
    run_dir = Path(run_dir)
    timeline = read_timeline(_timeline_path(run_dir))
    target = Path(out_dir) if out_dir is not None else run_dir
    trace = write_chrome_trace(timeline, target / "trace.json")
    picture = draw_timeline(timeline, target / "timeline.png")
    return {"trace": trace, "timeline": picture}


def _timeline_path(run_dir: Path) -> Path:
    path = run_dir / TIMELINE_FILE
    if not path.is_file():
        raise TimelineError(
            f"{run_dir} has no {TIMELINE_FILE}: it was not a pipeline run, or it recorded no "
            "timeline."
        )
    return path
