"""What a worker shows on the console while it trains: the progress bar (rank 0 only),
lines above it, and the epoch a step belongs to in a run by epochs."""

from __future__ import annotations

import sys
import threading
from typing import Any

from paratrain.config import TrainConfig
from paratrain.run.length import RunLength


def epoch_fields(length: RunLength, step: int, *, text: bool = False) -> dict[str, Any]:
    """``{"epoch": 2}`` (``"2/4"`` as text) in a run by epochs; nothing in one by steps."""
    if length.epochs is None:
        return {}
    epoch = length.epoch_of(step)
    return {"epoch": f"{epoch}/{length.epochs}" if text else epoch}


def console_line(line: str, bar) -> None:
    """One line on the console, above the progress bar where there is one."""
    if bar is None:
        print(line, flush=True)
    else:
        bar.write(line)


def progress_bar(config: TrainConfig, length: RunLength, *, enabled: bool, initial: int = 0):
    """The bar of steps (``--progress``), on the one process that draws it; else None."""
    if not (enabled and config.progress):
        return None

    from tqdm.auto import tqdm

    # One process draws the only bar, so a thread lock serves; tqdm's default also makes a
    # multiprocessing semaphore, which a worker stopped by Ctrl-C (SIGKILL) leaks, and the
    # resource tracker then prints a two-line warning under the run's one-line ending.
    tqdm.set_lock(threading.RLock())
    # Redrawn in place on a terminal; in a log file, a line every 10 s rather than a flood.
    interval = 0.2 if sys.stderr.isatty() else 10.0
    return tqdm(
        total=length.steps,
        desc=f"train {config.model}/{config.strategy}",
        unit="step",
        initial=initial,
        mininterval=interval,
    )
