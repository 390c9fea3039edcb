"""Imported by the forkserver that ``launch`` forks its workers from, and nowhere else.

multiprocessing's forkserver imports the modules named as its preload before it serves
(see ``worker_start``): this one loads paratrain, and with it torch, once for every
worker the server will fork. First it makes the server ignore SIGTERM: a preemption
signals every process of the job, and a server that died of it would take each worker
(armed to die with the server) down in the middle of its checkpoint. Importing paratrain
arms the server to die with the launcher (``parent_death``), so it never outlives it.

It loads torch's compiler front end too (``torch._dynamo``): the first optimizer any
process makes imports it (``torch.optim.Optimizer.add_param_group`` is wrapped to be
skipped by dynamo), about a second of a core in every worker of every launch, more than
the rest of a small launch takes (2 workers setting up dp and stepping once: 1.07 s a
launch after the server's start, 0.08 s with it loaded; 4 workers 2.2 s and 0.17 s on 2
cores). What torch and dynamo read from the environment as they are imported
(``TORCH_LOGS``, ``TORCH_COMPILE_DISABLE``, most ``TORCHINDUCTOR_*`` switches) is
therefore the environment of the server's start, the first launch; what they read when
used (``TORCHINDUCTOR_CACHE_DIR``) follows each launch, as every other variable does
(``worker_start``). ``PARATRAIN_START_METHOD=spawn`` gives fresh interpreters.

Each process the server forks (a worker, or any process the launching program starts
from its forkserver, which this server now is) starts as a fresh interpreter would on
two counts: SIGTERM's default action, and random state of its own (torch seeds its
generator from the OS in a fresh process; every fork would otherwise draw the server's
numbers; numpy's too, where the server imported it).
"""

import importlib
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

# torch's compiler front end, once for every worker (see the module docstring); after
# paratrain, whose import armed this server to die with its launcher. Only time is at
# stake: where it cannot be imported, each worker meets the same error as it would have
# without the server (at its first optimizer), not the server at its start.
try:
    importlib.import_module("torch._dynamo")
except Exception:  # noqa: BLE001
    pass
