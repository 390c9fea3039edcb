"""How ``launch`` starts its workers: forked from a server that has torch loaded already.

Why: a worker started by multiprocessing's ``spawn`` is a fresh interpreter that imports
torch and paratrain before it does anything, about 1.3 s of a core each: a launch of 2
workers took 1.8 s on 2 cores before its function ran, one of 4 took 3.8 s, on every
launch (the planner's measurements, a resumed run, each test). ``forkserver`` starts one
server per launcher, which imports paratrain (and so torch) once; each worker is then a
fork of it, ready in milliseconds (0.05 s for 2 workers, 0.10 s for 4 on 2 cores,
after the server's first start; ``benchmarks/launch_start.py``).

A fork of the server is not the fresh interpreter ``spawn`` gave, so what ``spawn`` gave
is given back, in ``WorkerPreparation.apply`` or at the fork itself (``forkserver_preload``):

- The environment is the launcher's at this launch, not the server's at its start (the
  server starts once, at the first launch; a variable set between launches must reach
  the workers). It is in place before ``fn`` and its arguments are unpickled, so that
  the modules imported to find ``fn`` read it (``DeferredCall``). What the modules the
  server imported (torch, its compiler front end: ``forkserver_preload``) read as they
  were imported stays the server's.
- Standard output and error are the launcher's at this launch: the server's are the
  launcher's at its start, and the launcher's may point elsewhere since (pytest's
  capture swaps them per test; a script may send them to a log between launches).
  ``LauncherStreams`` passes them with the worker as file descriptors.
- Random state: torch seeds its default generator from the OS in each fresh process; a
  fork would share the server's, and every worker would draw the same numbers (reseeded
  at each fork, ``forkserver_preload``).
- Dying with the launcher (``parent_death``): a worker's parent is now the server, not
  the launcher. The server dies with the launcher (it is started while the launcher's
  pid is exported, so importing paratrain arms it; its loop also ends once the launcher
  has gone) and each worker is armed to die with the server: a chain, both links in the
  kernel.
- A preemption signals every process of the job, the server too: a server that died of
  it would take the workers down with it through that chain, in the middle of their
  checkpoint. The server ignores SIGTERM and each fork has the default back
  (``forkserver_preload``).

Where forkserver is missing (Windows), or where the process already runs a forkserver
that this module did not start (its preload and signals are unknown), workers are
spawned as before; ``PARATRAIN_START_METHOD=spawn`` asks for that anywhere.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
from dataclasses import dataclass
from multiprocessing import forkserver
from multiprocessing.context import BaseContext
from multiprocessing.reduction import DupFd, ForkingPickler
from typing import Any

from paratrain.runtime.parent_death import (
    LAUNCHER_PID_ENV,
    die_with_parent,
    launcher_pid_exported,
)

START_METHOD_ENV = "PARATRAIN_START_METHOD"
START_METHODS = ("forkserver", "spawn")
PRELOAD_MODULE = "paratrain.runtime.forkserver_preload"
_started = {"server_pid": None}  # the forkserver this module started, in this process


@dataclass(frozen=True)
class WorkerPreparation:
    """What each worker is given first, before anything else runs there (see the module):
    the launcher's environment, the pid of the server it is forked from (None when
    spawned), and the launcher's stdout and stderr (None where spawned workers inherit
    them). It travels to the worker with its spec."""

    environ: dict[str, str]
    server_pid: int | None
    streams: LauncherStreams | None

    def apply(self) -> None:
        """In a worker, first: what a fresh interpreter would have had."""
        if self.server_pid is not None and self.streams is not None:  # forked
            die_with_parent(self.server_pid)  # the server, which dies with the launcher
            self.streams.put_in_place()  # (SIGTERM and random state: reset at the fork)
        os.environ.clear()
        os.environ.update(self.environ)


@dataclass(frozen=True)
class WorkerStart:
    """How this launch's workers start: the context, and what each is given first."""

    context: BaseContext
    preparation: WorkerPreparation


def start_method() -> str:
    """``PARATRAIN_START_METHOD`` where set, else forkserver wherever the platform has it."""
    available = mp.get_all_start_methods()
    named = os.environ.get(START_METHOD_ENV, "").strip()
    if not named:
        return "forkserver" if "forkserver" in available else "spawn"
    if named not in START_METHODS or named not in available:
        usable = [method for method in START_METHODS if method in available]
        raise ValueError(
            f"{START_METHOD_ENV}={named!r} is not a way paratrain can start workers here; "
            f"set it to one of {', '.join(usable)}, or unset it."
        )
    return named


def worker_start() -> WorkerStart:
    """The context to start this launch's workers with, the forkserver running and armed
    (``_our_forkserver``)."""
    environ = {name: value for name, value in os.environ.items() if name != LAUNCHER_PID_ENV}
    server_pid = _our_forkserver() if start_method() == "forkserver" else None
    if server_pid is None:
        return WorkerStart(mp.get_context("spawn"), WorkerPreparation(environ, None, None))
    preparation = WorkerPreparation(environ, server_pid, LauncherStreams())
    return WorkerStart(mp.get_context("forkserver"), preparation)


def start_server_early() -> None:
    """Start the server the next launch forks its workers from, now, where that launch
    would start it (armed to die with this process, as every server is).

    Why: the server imports paratrain, torch and torch's compiler front end, about 2.3 s
    of a core (``forkserver_preload``), and the first launch waits for that. A caller
    with work of its own before it launches (the command line checks the run, loads its
    data and builds its meta model: 1.1 s for the quick start's gpt on 2 cores) starts it
    first, and the import runs beside that work on another core. Nothing where workers
    will be spawned; an unknown ``PARATRAIN_START_METHOD`` is left to the launch, which
    refuses it in one sentence before any worker starts."""
    try:
        method = start_method()
    except ValueError:
        return
    if method == "forkserver":
        _our_forkserver()


def _our_forkserver() -> int | None:
    """The pid of the forkserver this module runs, started now if needed; None where the
    process already runs one it did not start, or the server's pid cannot be read. A
    server started here starts with this process's pid exported as its launcher's, so
    importing paratrain arms it to die with this process (``parent_death``)."""
    server = getattr(forkserver, "_forkserver", None)
    running = getattr(server, "_forkserver_pid", None)
    if server is None or running not in (None, _started["server_pid"]):
        return None
    forkserver.set_forkserver_preload([PRELOAD_MODULE])
    with launcher_pid_exported():
        forkserver.ensure_running()  # restarts a server that died
    _started["server_pid"] = getattr(server, "_forkserver_pid", None)
    return _started["server_pid"]


class LauncherStreams:
    """The launcher's stdout and stderr (file descriptors 1 and 2) as a worker starts,
    passed to it by multiprocessing with the worker's other descriptors."""

    def __init__(self, received: tuple[Any, Any] = ()) -> None:
        self._received = received  # in the worker: what multiprocessing passed

    def __reduce__(self) -> tuple:
        return LauncherStreams, ((DupFd(1), DupFd(2)),)  # only while a worker starts

    def put_in_place(self) -> None:
        for wrapped, standard in zip(self._received, (1, 2), strict=True):
            received = wrapped.detach()
            os.dup2(received, standard)
            os.close(received)


class DeferredCall:
    """``fn``, its args and kwargs, pickled as the worker starts (multiprocessing's own
    pickler, so its queues and torch's shared tensors pass as before) and unpickled only
    once ``WorkerPreparation.apply`` has put the launcher's environment in place."""

    def __init__(self, fn: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        self._call = (fn, args, kwargs)
        self._pickled: bytes | None = None

    def __getstate__(self) -> bytes:
        return bytes(ForkingPickler.dumps(self._call))

    def __setstate__(self, pickled: bytes) -> None:
        self._call = None
        self._pickled = pickled

    def load(self) -> tuple[Any, tuple, dict[str, Any]]:
        if self._call is None:
            self._call = pickle.loads(self._pickled)
        return self._call
