"""The one sentence for a real dataset that is neither on disk nor downloadable.

It is met on machines without network (a cluster's compute nodes, say), where the user
cannot read the loader's code to learn what it wanted, so the sentence says it all: every
file the dataset needs, every place that was searched (``--data-dir`` in each layout it is
read in, ``$PARATRAIN_DATA``, the download cache), and a command that puts the files where
the next run finds them.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from pathlib import Path

__all__ = ["DatasetUnavailable", "failure", "unavailable"]


class DatasetUnavailable(FileNotFoundError):
    """A dataset that is not on disk and could not be fetched; the message says where to put
    which files. A ``FileNotFoundError`` because that is what it is to the caller."""


def unavailable(
    title: str,
    files: Sequence[str],
    *,
    folder: str,
    layouts: Sequence[str],
    data_dir: str | Path | None,
    cache: Path,
    why: str,
) -> DatasetUnavailable:
    """The error for dataset ``title``, whose ``files`` were searched for in ``data_dir/L``
    for each layout ``L`` of ``layouts``, in ``$PARATRAIN_DATA/folder`` and in
    ``cache/folder``; ``why`` says why they were not fetched (a download's failure)."""

    def at(place: Path | str) -> str:
        # one file: its full path; several: the folder that holds them
        return os.path.join(place, files[0]) if len(files) == 1 else os.path.join(place, "")

    if data_dir is not None:
        root = Path(data_dir).expanduser()
        given = " or ".join(at(root / layout) for layout in layouts)
        searched = [f"--data-dir as {given}"]
    else:
        given = " or ".join(at(os.path.join("DIR", layout)) for layout in layouts)
        searched = [f"--data-dir as {given} (no --data-dir given)"]
    shared = os.environ.get("PARATRAIN_DATA")
    if shared:
        searched.append(f"$PARATRAIN_DATA as {at(Path(shared).expanduser() / folder)}")
    else:
        searched.append(
            f"$PARATRAIN_DATA as {at(os.path.join('$PARATRAIN_DATA', folder))} "
            "(PARATRAIN_DATA is not set)"
        )
    searched.append(f"the cache as {at(cache / folder)}")
    if data_dir is not None:
        target = Path(data_dir).expanduser() / folder
    elif shared:
        target = Path(shared).expanduser() / folder
    else:
        target = cache / folder
    command = (
        f"mkdir -p {shlex.quote(str(target))} && "
        f"cp {' '.join(map(shlex.quote, files))} {shlex.quote(os.path.join(target, ''))}"
    )
    names = files[0] if len(files) == 1 else ", ".join(files[:-1]) + " and " + files[-1]
    them = "it" if len(files) == 1 else "them"
    return DatasetUnavailable(
        f"{title} is not on disk and {why}; it needs {names}, looked for in "
        f"{', in '.join(searched[:-1])} and in {searched[-1]}; copy {them} from a machine "
        f"that has {them} and place {them} with `{command}`."
    )


def failure(error: OSError) -> str:
    """What went wrong in a download, without ``fetch``'s own advice (the sentence above
    gives more): the network's reason where there is one."""
    cause = error.__cause__
    return str(getattr(cause, "reason", cause) if cause is not None else error)
