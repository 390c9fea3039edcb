"""What the failure-path tests look at from outside a job: its live processes."""

from __future__ import annotations

import os
from pathlib import Path


def process_group(pgid: int) -> list[int]:
    """Every live process of a process group (the launcher, its workers, ps's servers)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == pgid:
                    found.append(int(entry))
            except OSError:
                continue
    return found


def parents() -> dict[int, int]:
    """Every live process's parent, by pid."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            found[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    return found


def command(pid: int) -> str:
    """A live process's command line (what a failed check shows), or "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    except OSError:
        return ""


def descendants(root: int) -> list[int]:
    """Every live process below ``root``: a launcher's workers, the forkserver they are
    forked from (``runtime/worker_start``), multiprocessing's resource tracker."""
    by_parent = parents()
    found, frontier = [], {root}
    while frontier:
        frontier = {pid for pid, parent in by_parent.items() if parent in frontier}
        found += sorted(frontier)
    return found


def launched_workers(launcher: int) -> list[int]:
    """A launcher's worker processes: spawned as its children, or forked by its forkserver
    (not the server itself, nor multiprocessing's resource tracker)."""
    by_parent = parents()
    servers = {
        pid
        for pid, parent in by_parent.items()
        if parent == launcher and "forkserver" in command(pid)
    }
    return [
        pid
        for pid, parent in by_parent.items()
        if (parent == launcher and "spawn_main" in command(pid)) or parent in servers
    ]
