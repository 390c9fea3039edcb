"""The run folder: which one a run writes to, whether it may, and making it.

Decided once, before any worker starts, and under torchrun by rank 0 alone (``fit`` passes
``settle_run_folder`` to ``decided_once``): a default name read off each rank's own clock
would differ between ranks that start either side of a second boundary, and rank 1 would
then write its share of a checkpoint into a folder rank 0 never made.

Refused in one sentence each, before anything is written: a folder that already holds a
run (its ``final/`` would be replaced and its ``metrics.jsonl`` appended to, one report of
two runs) unless ``--overwrite``; a path that is a file; a place this process cannot
write. ``--overwrite`` moves the old folder aside with one rename before the new one is
made, so a crash leaves the old run whole or no run, never a mix.
"""

from __future__ import annotations

import os
import shutil
from datetime import datetime
from pathlib import Path

from paratrain.config import ConfigError, TrainConfig

RUN_MARKERS = ("metrics.jsonl", "final", "checkpoints")
"""What a run leaves in its folder; any one of them means the folder holds a run."""


def default_run_dir(config: TrainConfig, now: datetime | None = None) -> Path:
    """``runs/<model>-<strategy>-<time>``; ``now`` is the deciding process's clock."""
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{config.model}-{config.strategy}-{stamp}"


def holds_run(path: Path) -> bool:
    """True where ``path`` is a folder a run has written to."""
    return path.is_dir() and any((path / marker).exists() for marker in RUN_MARKERS)


def free_name(path: Path) -> Path:
    """The first of ``PATH-2``, ``PATH-3``, ... that does not exist (named in a refusal)."""
    n = 2
    while path.with_name(f"{path.name}-{n}").exists():
        n += 1
    return path.with_name(f"{path.name}-{n}")


def check_run_dir(path: Path, *, resumed_in: Path | None, overwrite: bool) -> None:
    """Refuse a run folder this run must not or cannot write to, in one sentence."""
    if path.exists() and not path.is_dir():
        raise ConfigError(
            f"--run-dir {path} is a file, not a folder; pass a folder name such as "
            f"{free_name(path)}."
        )
    same = resumed_in is not None and _same(path, resumed_in)
    if overwrite and same:
        raise ConfigError(
            f"--overwrite would remove {path}, the run --resume continues; drop --overwrite, "
            "or pass a new --run-dir for the resumed run."
        )
    if holds_run(path) and not same and not overwrite:
        raise ConfigError(
            f"{path} already holds a run; pass --resume {path} to continue it, "
            f"--run-dir {free_name(path)} for a new one, or --overwrite to replace it."
        )
    check_writable(path, resuming=same)


def check_writable(path: Path, *, resuming: bool = False) -> None:
    """Refuse a run folder (or, not yet made, its nearest existing parent) that this
    process may not write to: found here, it is one sentence; found by a worker, it was a
    traceback from every worker after they had started."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    targets = [existing] + [existing / m for m in ("metrics.jsonl",) if existing == path]
    for target in targets:
        if target.exists() and not os.access(target, os.W_OK | (os.X_OK * target.is_dir())):
            if resuming:
                raise ConfigError(
                    f"cannot write to {target}, and a resumed run writes its checkpoints "
                    f"and metrics into {path}; make it writable, or pass --run-dir with a "
                    "writable folder for the resumed run."
                )
            what = (
                f"cannot write to {target}"
                if existing == path
                else f"cannot make the run folder {path}: {existing} is not writable"
            )
            raise ConfigError(f"{what}; pass --run-dir with a folder in a writable place.")


def make_run_dir(path: Path, *, overwrite: bool) -> bool:
    """Make the run folder (after ``check_run_dir``); True if this call made it. Under
    ``--overwrite`` the old run is renamed aside in one step, then removed."""
    try:
        if overwrite and holds_run(path):
            if Path.cwd().resolve().is_relative_to(path.resolve()):
                raise ConfigError(
                    f"--overwrite would remove {path}, which holds the current folder; "
                    "pass a --run-dir outside it."
                )
            retired = path.with_name(f".{path.name}.overwritten-{os.getpid()}")
            os.replace(path, retired)
            path.mkdir()
            shutil.rmtree(retired, ignore_errors=True)
            return True
        created = not path.exists()
        path.mkdir(parents=True, exist_ok=True)
        return created
    except OSError as error:
        raise ConfigError(
            f"cannot make the run folder {path} ({error.strerror}); pass --run-dir with a "
            "folder in a writable place."
        ) from None


def _same(a: Path, b: Path) -> bool:
    return a.resolve() == b.resolve()
