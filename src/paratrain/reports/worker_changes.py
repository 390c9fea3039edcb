"""An elastic run's changes of worker count, as the summary, the report and the plots say them.

Why one module: the console summary (from the records the workers wrote), ``paratrain
report`` and the plots must tell the same story of a run whose worker count changed (a
worker lost, a replacement joined), and each ``workers`` record in ``metrics.jsonl``
(``run/elastic.Change``) is its only source.
"""

from __future__ import annotations

from typing import Any

__all__ = ["change_label", "counts_line", "worker_counts"]


def worker_counts(start: int, changes: list[dict[str, Any]]) -> list[int]:
    """The worker count at the start and after each change, in order."""
    return [start, *(int(c["new_workers"]) for c in changes)]


def change_label(change: dict[str, Any]) -> str:
    """``4 -> 3`` with who left or joined: a change as a plot's annotation says it."""
    who = [f"-{r}" for r in change.get("lost_ranks", [])]
    who += [f"+{r}" for r in change.get("joined_ranks", [])]
    return f"{change['old_workers']}->{change['new_workers']} ({' '.join(who)})"


def counts_line(start: int, changes: list[dict[str, Any]]) -> str:
    """The summary's sentence: start and end counts, then each change with its step,
    who left or joined, the steps redone and the seconds it cost."""
    counts = worker_counts(start, changes)
    head = f"{counts[0]} at the start, {counts[-1]} at the end"
    if not changes:
        return head
    parts = []
    for change in changes:
        who = []
        if change.get("lost_ranks"):
            who.append(f"lost {', '.join(map(str, change['lost_ranks']))}")
        if change.get("joined_ranks"):
            who.append(f"joined {', '.join(map(str, change['joined_ranks']))}")
        redone = int(change.get("steps_redone", 0))
        who.append(f"{redone} step(s) redone, {float(change.get('seconds_lost', 0)):.2f} s lost")
        parts.append(
            f"step {change['step']}: {change['old_workers']} -> {change['new_workers']} "
            f"({'; '.join(who)})"
        )
    return f"{head}; {', '.join(parts)}"
