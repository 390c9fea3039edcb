"""Imported by the forkserver that ``launch`` forks its workers from, and nowhere else.

multiprocessing's forkserver imports the modules named as its preload before it serves
(see ``worker_start``): this one loads paratrain, and with it torch, once for every
worker the server will fork. First it makes the server ignore SIGTERM: a preemption
signals every process of the job, and a server that died of it would take each worker
(armed to die with the server) down in the middle of its checkpoint. Importing paratrain
arms the server to die with the launcher (``parent_death``), so it never outlives it.

Each process the server forks (a worker, or any process the launching program starts
from its forkserver, which this server now is) starts as a fresh interpreter would on
two counts: SIGTERM's default action, and random state of its own (torch seeds its
generator from the OS in a fresh process; every fork would otherwise draw the server's
numbers; numpy's too, where the server imported it).
"""

import os
import signal
import sys

signal.signal(signal.SIGTERM, signal.SIG_IGN)

import torch  # noqa: E402 - after the signal: the import takes a second or more

import paratrain  # noqa: E402, F401


def _as_a_fresh_process() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    torch.seed()
    if "numpy.random" in sys.modules:  # else numpy seeds itself from the OS on import
        sys.modules["numpy.random"].seed()


os.register_at_fork(after_in_child=_as_a_fresh_process)
