"""Imported by the forkserver that ``launch`` forks its workers from, and nowhere else.

multiprocessing's forkserver imports the modules named as its preload before it serves
(see ``worker_start``): this one loads paratrain, and with it torch, once for every
worker the server will fork. First it makes the server ignore SIGTERM: a preemption
signals every process of the job, and a server that died of it would take each worker
(armed to die with the server) down in the middle of its checkpoint. Importing paratrain
arms the server to die with the launcher (``parent_death``), so it never outlives it.
"""

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)

import paratrain  # noqa: E402, F401 - after the signal: the import takes a second or more
