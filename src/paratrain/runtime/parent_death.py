"""A worker process dies with the process that launched it, at any moment of its life.

Why: a launcher killed with ``kill -9`` (an impatient user, the OOM killer, a scheduler
that gave up waiting) cannot stop its workers, and a worker it left behind is reparented
and lives on, holding its memory (~230 MB once torch is loaded), until a collective's
timeout ends it minutes later, or never, if it is still waiting for a rendezvous.

How: on Linux the kernel kills a process whose parent died once the process has asked for
it (``prctl(PR_SET_PDEATHSIG, SIGKILL)``); elsewhere a thread watches the parent's pid
and exits the process once it changes (the orphan was reparented). Either must be armed
as early as possible: a spawned worker spends its first seconds importing torch, and the
launcher may die then. So this module arms it when it is imported, and it is the first
thing ``paratrain.runtime`` imports, which ``paratrain`` imports before anything that
loads torch: importing ``paratrain``, which a spawned worker does to find its target
function, arms it before torch loads. It acts only in a process whose environment
names its parent as the launcher (``LAUNCHER_PID_ENV``, set by ``launch`` around the
start of its workers and removed from the worker's environment here, so that a worker's
own children, such as ps's servers, are not taken for launched workers).

A launcher that died before the worker armed it is seen at once (the worker's parent is
no longer the launcher) and the worker exits.

Workers forked from ``launch``'s forkserver (see ``worker_start``) are the server's
children, not the launcher's: the server is armed here as it imports paratrain (it
starts with the mark), and each worker is armed to die with the server
(``die_with_parent``), so the kernel ends both in turn.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

LAUNCHER_PID_ENV = "PARATRAIN_LAUNCHER_PID"
EXIT_ORPHANED = 1  # the launcher is gone: nobody reads this code, but it is not success
_WATCH_INTERVAL_S = 0.5
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@contextmanager
def launcher_pid_exported() -> Iterator[None]:
    """In the launcher: while starting workers, name this process as their launcher in
    the environment they inherit."""
    previous = os.environ.get(LAUNCHER_PID_ENV)
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(LAUNCHER_PID_ENV, None)
        else:
            os.environ[LAUNCHER_PID_ENV] = previous


def die_with_launcher() -> None:
    """In a process ``launch`` spawned: from now on, die when the launcher dies; exit now
    if it already has. Does nothing in any other process."""
    named = os.environ.pop(LAUNCHER_PID_ENV, None)
    if named is not None:
        die_with_parent(int(named))


def die_with_parent(parent: int) -> None:
    """From now on, die when ``parent``, this process's parent, dies; exit now if it
    already has (this process was reparented). A worker forked from ``launch``'s server
    calls it with the server's pid (see ``worker_start``)."""
    if _ask_kernel_for_parent_death_signal():
        _exit_if_orphaned(parent)  # the parent may have died before we asked
        return
    _exit_if_orphaned(parent)
    threading.Thread(
        target=_watch, args=(parent,), name="paratrain-parent-watch", daemon=True
    ).start()


def _ask_kernel_for_parent_death_signal() -> bool:
    """Linux: SIGKILL this process when its parent dies. False where that is unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _exit_if_orphaned(parent: int) -> None:
    if os.getppid() != parent:
        os._exit(EXIT_ORPHANED)


def _watch(parent: int) -> None:
    while True:
        _exit_if_orphaned(parent)
        time.sleep(_WATCH_INTERVAL_S)


die_with_launcher()
