"""``report.png``: one run, or several overlaid on the same axes, as a grid of panels.

Panels: loss against step and against wall time (train solid, eval dashed), samples/s
against step, accuracy where any record has it, each worker's peak memory by ledger
category, and for ps runs the staleness histogram of applied pushes and each worker's
pushes. Several runs share every axis, one colour per run, so dp against ps or fp32
against bf16 read off one picture; a legend at the top names each run's colour. Where a
run was resumed or restarted, a dash-dotted line in its colour marks where each later attempt
took over (the ``config`` record each attempt writes says at which step); where an elastic
run's worker count changed, a dotted line in its colour, labelled ``4->3 (-1)``, marks the
step (the ``workers`` records say where).

Drawn on a bare ``Figure`` with the Agg canvas (no pyplot), so a caller's backend and open
figures stay as they were.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from paratrain.reports.run_data import RunMetrics
from paratrain.reports.worker_changes import change_label

__all__ = ["ATTEMPT_GID", "PANEL_TITLES", "WORKERS_GID", "build_figure", "draw_runs"]

PANEL_TITLES = {
    "loss_step": "loss against step",
    "loss_time": "loss against wall time",
    "throughput": "samples/s against step",
    "accuracy": "accuracy against step",
    "memory": "peak memory per worker, by ledger category",
    "staleness": "ps: applied pushes by staleness",
    "pushes": "ps: pushes per worker",
}
_CATEGORY_COLOURS = {
    "parameters": "#4C8BD6",
    "gradients": "#F28E2B",
    "optimizer": "#59A14F",
    "activations": "#E15759",
    "communication": "#B07AA1",
}
_UNITS = (("B", 1), ("KiB", 1 << 10), ("MiB", 1 << 20), ("GiB", 1 << 30))


def draw_runs(runs: list[RunMetrics], path: str | Path) -> list[str]:
    """Write the report picture of ``runs`` to ``path`` (PNG); returns the panel titles,
    in drawing order (what a test or a caller can check without reading pixels)."""
    fig, titles = build_figure(runs)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return titles


def build_figure(runs: list[RunMetrics]) -> tuple[Any, list[str]]:
    """The report's ``Figure`` and its panel titles: the objects a test reads (legends,
    lines) rather than pixels."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise RuntimeError(
            'Drawing the report needs matplotlib: pip install "paratrain[report]".'
        ) from error
    if not runs:
        raise ValueError("draw_runs needs at least one run.")
    panels = _panels(runs)
    rows = (len(panels) + 1) // 2
    fig = Figure(figsize=(13, 0.9 + 3.6 * rows), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, 2, squeeze=False).ravel()
    colours = _run_colours(len(runs))
    for ax, key in zip(axes, panels, strict=False):
        _DRAW[key](ax, runs, colours)
        ax.set_title(PANEL_TITLES[key], loc="left", fontsize=10)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    if len(runs) > 1:  # the legend names the runs, in place of a title listing them
        _run_legend(fig, runs, colours)
    else:
        fig.suptitle(_figure_title(runs), fontsize=11)
    return fig, [PANEL_TITLES[key] for key in panels]


def _panels(runs: list[RunMetrics]) -> list[str]:
    panels = ["loss_step", "loss_time", "throughput"]
    if any(run.has_accuracy for run in runs):
        panels.append("accuracy")
    panels.append("memory")
    if any(_ps_metrics(run) for run in runs):
        panels += ["staleness", "pushes"]
    return panels


def _figure_title(runs: list[RunMetrics]) -> str:
    if len(runs) == 1:
        run = runs[0]
        return (
            f"paratrain report {run.name}: {run.config.get('model', '?')} on "
            f"{run.config.get('dataset', '?')}, strategy {run.strategy}, "
            f"{run.workers if run.workers is not None else '?'} worker(s)"
        )
    return f"paratrain report: {len(runs)} runs compared"


def _label(run: RunMetrics) -> str:
    """A run's name in legends: its folder, with its strategy and precision (not fp32)
    where the folder's name does not already say them."""
    precision = run.config.get("precision", "fp32")
    said = [w for w in (run.strategy, precision) if w not in run.name and w != "fp32"]
    return f"{run.name} ({', '.join(said)})" if said else run.name


def _run_legend(fig, runs: list[RunMetrics], colours: list) -> None:
    """One legend naming each run's colour, at the top under the title, where the eye
    starts (it once sat only under the last panels of a tall figure)."""
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=_label(r)) for r, c in zip(runs, colours, strict=True)]
    settings = {"handles": handles, "ncol": len(runs), "fontsize": 9, "title": _figure_title(runs)}
    try:  # "outside" keeps it clear of the panels under constrained layout (matplotlib 3.7+)
        fig.legend(loc="outside upper center", **settings)
    except ValueError:
        fig.legend(loc="upper right", **settings)


def _run_colours(count: int) -> list[str]:
    from matplotlib import colormaps

    palette = colormaps["tab10"].colors
    return [palette[i % len(palette)] for i in range(count)]


def _ps_metrics(run: RunMetrics) -> dict[str, Any] | None:
    """The strategy's figures when they hold ps's staleness histogram and pushes."""
    metrics = run.strategy_metrics
    if metrics and "staleness_histogram" in metrics and "pushes" in metrics:
        return metrics
    return None


# ---------------------------------------------------------------------------- curves


def _widths(count: int) -> list[float]:
    """Line widths, widest first: runs whose curves coincide (dp and ps take the same
    steps) still show, each a band around the next."""
    return [1.4 + 1.8 * (count - 1 - i) / max(count - 1, 1) for i in range(count)]


def _loss_lines(ax, runs: list[RunMetrics], colours: list, x: str) -> None:
    for run, colour, width in zip(runs, colours, _widths(len(runs)), strict=True):
        if run.train:
            ax.plot(
                [r[x] for r in run.train],
                [r["loss"] for r in run.train],
                color=colour,
                linewidth=width,
            )
        if run.evals:
            ax.plot(
                [r[x] for r in run.evals],
                [r["eval_loss"] for r in run.evals],
                color=colour,
                linewidth=width,
                linestyle="--",
                marker="o",
                markersize=3,
            )
    _mark_attempts(ax, runs, colours, x)
    _mark_worker_changes(ax, runs, colours, x)
    ax.set_xlabel("step" if x == "step" else "wall time since training started (s)")
    ax.set_ylabel("loss")
    ax.grid(color="0.92")
    styles = [("-", None, "train"), ("--", "o", "eval")]
    _style_legend(ax, runs, colours, styles + _attempt_styles(runs) + _change_styles(runs))


_ATTEMPT_STYLE = "-."  # where an attempt after the first took over
ATTEMPT_GID = "attempt-start"
"""The ``gid`` of those lines (how a caller finds them among the curves)."""


def _mark_attempts(ax, runs: list[RunMetrics], colours: list, x: str) -> None:
    """A vertical line in the run's colour where each resumed or restarted attempt started
    (at its checkpoint's step, or the wall time then)."""
    for run, colour in zip(runs, colours, strict=True):
        for start in run.attempts:
            ax.axvline(
                start.step if x == "step" else start.time_s,
                color=colour,
                linestyle=_ATTEMPT_STYLE,
                linewidth=1.0,
                gid=ATTEMPT_GID,
            )


_WORKERS_STYLE = ":"
WORKERS_GID = "worker-count-change"
"""The ``gid`` of the lines marking an elastic run's changes of worker count."""


def _mark_worker_changes(ax, runs: list[RunMetrics], colours: list, x: str) -> None:
    """A dotted vertical line in the run's colour at each change of worker count (at its
    step, or the wall time then), labelled with the counts and who left or joined."""
    for run, colour in zip(runs, colours, strict=True):
        for change in run.worker_changes:
            where = change["step"] if x == "step" else change["time_s"]
            ax.axvline(
                where, color=colour, linestyle=_WORKERS_STYLE, linewidth=1.2, gid=WORKERS_GID
            )
            ax.annotate(
                change_label(change),
                xy=(where, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(2, -10),
                textcoords="offset points",
                fontsize=7,
                color=colour,
                gid=WORKERS_GID,
            )


def _change_styles(runs: list[RunMetrics]) -> list:
    """The legend entry for the worker-count lines, where any run has them."""
    if not any(run.worker_changes for run in runs):
        return []
    return [(_WORKERS_STYLE, None, "worker count changes (elastic)")]


def _attempt_styles(runs: list[RunMetrics]) -> list:
    """The legend entry for the attempt lines, where any run has them."""
    starts = [start for run in runs for start in run.attempts]
    if not starts:
        return []
    kinds = sorted({"restart" if s.restart else "resume" for s in starts}, reverse=True)
    return [(_ATTEMPT_STYLE, None, f"attempt starts ({' / '.join(kinds)})")]


def _style_legend(ax, runs: list[RunMetrics], colours: list, styles: list) -> None:
    """A legend of line styles (``(linestyle, marker, label)``): in the run's colour for
    one run, in grey for several (whose colours the figure's legend names)."""
    from matplotlib.lines import Line2D

    colour = colours[0] if len(runs) == 1 else "0.35"
    handles = [
        Line2D([], [], color=colour, linestyle=style, marker=marker, markersize=3, label=label)
        for style, marker, label in styles
    ]
    if ax.has_data():
        ax.legend(handles=handles, fontsize=8)


def _draw_loss_step(ax, runs, colours) -> None:
    _loss_lines(ax, runs, colours, "step")


def _draw_loss_time(ax, runs, colours) -> None:
    _loss_lines(ax, runs, colours, "time_s")


def _draw_throughput(ax, runs, colours) -> None:
    for run, colour in zip(runs, colours, strict=True):
        logged = [r for r in run.train if r.get("samples_per_s")]  # the first step: 0
        if logged:
            ax.plot([r["step"] for r in logged], [r["samples_per_s"] for r in logged], color=colour)
        if run.samples_per_s is not None:  # dashed: dotted marks a change of workers
            ax.axhline(run.samples_per_s, color=colour, linestyle="--")
    _mark_attempts(ax, runs, colours, "step")
    _mark_worker_changes(ax, runs, colours, "step")
    ax.set_xlabel("step")
    ax.set_ylabel("samples/s")
    ax.set_ylim(bottom=0)
    ax.grid(color="0.92")
    shares = [run.name for run in runs if run.per_step_throughput_is_share]
    share = f" ({', '.join(shares)}: worker 0's share)" if shares else ""
    whole = "whole run, all workers"
    if len(runs) == 1 and runs[0].samples_per_s is not None:
        whole += f": {runs[0].samples_per_s:,.0f}"
    styles = [("-", None, f"running mean from the second step{share}"), ("--", None, whole)]
    _style_legend(ax, runs, colours, styles + _attempt_styles(runs) + _change_styles(runs))


def _draw_accuracy(ax, runs, colours) -> None:
    for run, colour in zip(runs, colours, strict=True):
        for records, style, kind in ((run.train, "-", "train"), (run.evals, "--", "eval")):
            scored = [r for r in records if "accuracy" in r]
            if scored:
                ax.plot(
                    [r["step"] for r in scored],
                    [100 * r["accuracy"] for r in scored],
                    color=colour,
                    linestyle=style,
                    marker="o" if kind == "eval" else None,
                    markersize=3,
                )
    _mark_attempts(ax, runs, colours, "step")
    ax.set_xlabel("step")
    ax.set_ylabel("accuracy (%)")
    ax.grid(color="0.92")
    styles = [("-", None, "train"), ("--", "o", "eval")]
    _style_legend(ax, runs, colours, styles + _attempt_styles(runs))


# ---------------------------------------------------------------------------- bars


def _draw_memory(ax, runs, colours) -> None:
    """A horizontal bar per worker, stacked by ledger category (peaks)."""
    rows = [
        (f"{run.name} w{worker}" if len(runs) > 1 else f"worker {worker}", record)
        for run in runs
        for worker, record in run.memory.items()
    ]
    if not rows:
        ax.text(0.5, 0.5, "no memory records", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    largest = max((r.get("peak_total") or 0) for _, r in rows)
    unit, scale = next(((u, s) for u, s in reversed(_UNITS) if largest >= s), _UNITS[0])
    categories = list(dict.fromkeys(c for _, r in rows for c in (r.get("peak") or {})))
    for y, (_, record) in enumerate(rows):
        peak = record.get("peak") or {}
        if not peak:
            ax.text(0, y, "  not measured (no ledger)", va="center", fontsize=8, color="0.4")
            continue
        left = 0.0
        for category in categories:
            width = peak.get(category, 0) / scale
            ax.barh(y, width, left=left, color=_CATEGORY_COLOURS.get(category, "0.6"))
            left += width
    for category in categories:  # one legend entry per category
        ax.barh(0, 0, color=_CATEGORY_COLOURS.get(category, "0.6"), label=category)
    ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"peak bytes ({unit}); each category's own peak")
    ax.grid(axis="x", color="0.92")
    ax.set_axisbelow(True)
    if categories:  # below the axis: bars fill the panel's width
        ax.legend(
            fontsize=8,
            loc="upper center",
            bbox_to_anchor=(0.5, -0.2),
            ncol=len(categories),
            frameon=False,
        )


def _grouped_bars(ax, runs, colours, values_of) -> None:
    """Bars of ``values_of(metrics) -> {x: value}`` per run, side by side at each x."""
    drawn = [(run, colour, _ps_metrics(run)) for run, colour in zip(runs, colours, strict=True)]
    drawn = [(run, colour, m) for run, colour, m in drawn if m is not None]
    width = 0.8 / len(drawn)
    ticks: set[int] = set()
    for index, (run, colour, metrics) in enumerate(drawn):
        values = {int(k): v for k, v in values_of(metrics).items()}
        xs = sorted(values)
        offset = (index - (len(drawn) - 1) / 2) * width
        bars = ax.bar(
            [x + offset for x in xs],
            [values[x] for x in xs],
            width=width,
            color=colour,
            label=_label(run),
        )
        ax.bar_label(bars, fontsize=8)
        ticks.update(xs)
    # Integer ticks at the values only, with room either side (one bar would fill the axis).
    ax.set_xticks(sorted(ticks))
    ax.set_xlim(min(ticks, default=0) - 1, max(ticks, default=0) + 1)
    ax.margins(y=0.12)
    ax.grid(axis="y", color="0.92")
    ax.set_axisbelow(True)


def _draw_staleness(ax, runs, colours) -> None:
    _grouped_bars(ax, runs, colours, lambda m: m["staleness_histogram"])
    ax.set_xlabel("staleness (server versions behind when applied)")
    ax.set_ylabel("pushes applied")


def _draw_pushes(ax, runs, colours) -> None:
    _grouped_bars(ax, runs, colours, lambda m: m["pushes"])
    rates = [
        ", ".join(f"w{w} {r:.1f}/s" for w, r in sorted((int(w), r) for w, r in rates.items()))
        for rates in (m.get("pushes_per_s", {}) for m in map(_ps_metrics, runs) if m)
    ]
    ax.set_xlabel("worker" + (f"   (pushes/s: {'; '.join(rates)})" if rates else ""))
    ax.set_ylabel("pushes")


_DRAW = {
    "loss_step": _draw_loss_step,
    "loss_time": _draw_loss_time,
    "throughput": _draw_throughput,
    "accuracy": _draw_accuracy,
    "memory": _draw_memory,
    "staleness": _draw_staleness,
    "pushes": _draw_pushes,
}
