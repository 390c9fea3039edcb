"""How a run reacts to SIGTERM (a scheduler's preemption notice) and to Ctrl-C.

Why two different answers: SIGTERM means "you will be killed soon; save what you can", so
the workers finish the step they are in, write a checkpoint and return, and the run can be
resumed from it. Ctrl-C is a person who wants the run to stop now: the launching process
stops the workers without a checkpoint and says so in one line, no traceback.

The parent forwards SIGTERM to its workers (a scheduler may signal only the process it
started), and workers ignore SIGINT (the terminal sends it to the whole process group),
so the parent alone decides how an interrupt ends the run.

Workers of a synchronous engine must stop after the same step, or the checkpoint (a
collective) would wait for a worker still training. So each step they agree, with one
all-reduce of a single number, on whether any of them was told to stop. Workers that never
wait on each other (``Engine.independent_workers``, the parameter server) each stop on
their own notice instead. A scheduler's SIGTERM often reaches every process of the job;
ps's servers ignore it (their life is bounded by the workers'), so that they are still
there to write the checkpoint the workers ask for.

Such a job's workers get SIGTERM twice: the scheduler's own, and the copy the launcher
forwards (ours, or torchrun's agent). The copy may land at any moment after the first,
under load long after the worker ended its loop, while it writes its share of the
checkpoint or sends its report: a worker that died of it there lost the checkpoint (in ps,
where each worker stops on its own notice, both workers died so, 1 run in 10 under load,
and the run ended "before the workers could write a checkpoint"). So a worker's first
SIGTERM is its only one: from then on the signal is ignored for the rest of the process's
life, which is short (it checkpoints, reports and exits; the launcher SIGKILLs a worker
that outstays its grace, and the kernel one whose launcher died).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

EXIT_PREEMPTED = 143  # 128 + SIGTERM: the shell's code for a run ended by SIGTERM
EXIT_INTERRUPTED = 130  # 128 + SIGINT


def ignore_interrupts() -> None:
    """In a worker: leave Ctrl-C to the launching process (see the module docstring)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextmanager
def forwarding_termination(processes: list) -> Iterator[list[bool]]:
    """In the launching process: pass SIGTERM on to every live worker while the block runs.

    Yields a one-element list that turns ``[True]`` once a SIGTERM arrived. Outside the
    main thread (where Python cannot install handlers) nothing is forwarded.
    """
    received = [False]
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def forward(signum, frame) -> None:
        received[0] = True
        for process in processes:
            if process.pid is not None and process.is_alive():
                process.terminate()

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)


class TerminationNotice:
    """In a worker, from its first step until its report is made: remember a SIGTERM
    instead of dying of it; after the first, ignore the signal (see the module docstring).
    """

    def __init__(self) -> None:
        self.received = False
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._note)

    def _note(self, signum, frame) -> None:
        self.received = True
        # Ignored by the kernel from now on, not merely noted again: a repeat then cannot
        # even interrupt a system call of the checkpoint being written.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def agreed(self, *, independent: bool, device: torch.device) -> bool:
        """Whether to stop after this step: any worker's notice, or this worker's own
        where the workers are independent (see the module docstring)."""
        if independent or not dist.is_initialized() or dist.get_world_size() == 1:
            return self.received
        flag = torch.tensor([1.0 if self.received else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def close(self) -> None:
        """Give SIGTERM its previous meaning back where none arrived (a worker that returns
        may be stopped); a worker told to stop stays told, and ignores it."""
        if self._previous is not None and not self.received:
            signal.signal(signal.SIGTERM, self._previous)
        self._previous = None
