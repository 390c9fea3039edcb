"""``paratrain report``: a run's summary, report.png and timeline; several runs compared."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from paratrain.config import ConfigError
from paratrain.parallel import strategy_class, strategy_names
from paratrain.parallel.description import DrawsTimeline
from paratrain.parallel.strategy import TIMELINE_FILE
from paratrain.reports.compare import compare_rows, format_compare
from paratrain.reports.plot import draw_runs
from paratrain.reports.run_data import RunMetrics, load_run
from paratrain.reports.text import summarize_run


def report_command(args: argparse.Namespace) -> int:
    """``paratrain report RUN_DIR...``: one run's summary and pictures, or several compared."""
    run_dirs = [Path(d) for d in args.run_dirs]
    if len(run_dirs) > 1:
        return _compare([_load(d) for d in run_dirs], args.out)
    run_dir = run_dirs[0]
    metrics_file = run_dir / "metrics.jsonl"
    if not metrics_file.exists() and not (run_dir / TIMELINE_FILE).exists():
        raise ConfigError(f"{run_dir} holds no metrics.jsonl; pass the folder of a paratrain run.")
    strategy = None
    if metrics_file.exists():
        run = load_run(run_dir)
        strategy = run.config.get("strategy")
        print(summarize_run(run))
        picture = Path(args.out or run_dir) / "report.png"
        draw_runs([run], picture)
        print(f"  {'report':<20}{picture}")
    if (run_dir / TIMELINE_FILE).exists():
        recorder = _timeline_recorder(strategy)
        try:  # a timeline that cannot be read is refused with the reader's sentence
            print(recorder.summarize_timeline(run_dir))
            drawn = recorder.report_timeline(run_dir, out_dir=args.out)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        for kind, path in drawn.items():
            print(f"  {kind:<20}{path}")
    return 0


def _load(run_dir: Path) -> RunMetrics:
    try:
        return load_run(run_dir)
    except FileNotFoundError as error:
        raise ConfigError(str(error)) from None


def _compare(runs: list[RunMetrics], out: str | None) -> int:
    """Several runs: one table of headline figures, one picture with the runs overlaid."""
    names = [run.name for run in runs]
    if len(set(names)) < len(names):  # legends and table rows name runs by folder
        runs = [replace(run, display_name=str(run.run_dir)) for run in runs]
    print(format_compare(compare_rows(runs)))
    picture = Path(out or ".") / "compare.png"
    draw_runs(runs, picture)
    print(f"  {'report':<20}{picture}")
    return 0


def _timeline_recorder(strategy: str | None):
    """The engine class that draws a run's timeline: the run's own strategy where it
    records one, else the first registered strategy that does."""
    recorders = [
        strategy_class(name)
        for name in strategy_names()
        if issubclass(strategy_class(name), DrawsTimeline)
    ]
    by_name = {cls.name: cls for cls in recorders}
    return by_name.get(strategy, recorders[0])
