"""What the failure-path tests look at from outside a job: its live processes."""

from __future__ import annotations

import os


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
