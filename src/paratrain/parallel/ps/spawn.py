"""Starting a job's server processes and joining the workers-plus-servers gloo group.

Why worker 0 starts the servers with ``subprocess`` and ``python -m``: the user's call is
``paratrain.launch(fn, devices=N)`` and must stay so; the servers are extra processes the
engine owns. A fresh interpreter inherits none of the worker's threads or sockets (a fork
of a process that already runs gloo and OpenMP threads is not safe).

Why the servers do not die with worker 0 (no parent-death signal): a worker that dies must
not take the servers with it. Their lifetime is bounded by the job instead: a server exits
once every worker said goodbye or died, or when the launch store disappears.

Why a standalone ``ProcessGroupGloo`` over a prefix of the launch store: ``dist.new_group``
can only take members of the default group, and the servers are not members; the
standalone group of size N + servers (workers first, then servers) is used only for the
point-to-point messages of this engine, never for collectives, so a dead worker hangs
nobody.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from paratrain.parallel.ps import jobkeys
from paratrain.runtime.hang import STORE_ENV

_SERVER_MODULE = "paratrain.parallel.ps.server"


def start_servers(store: dist.Store, prefix: str, spec: dict) -> list[subprocess.Popen]:
    """Publish the job's description and start one process per server (worker 0 only)."""
    store.set(jobkeys.spec_key(prefix), json.dumps(spec))
    env = dict(os.environ)
    # The optimizer class is imported by name in the server: give it the worker's path.
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    command = [sys.executable, "-m", _SERVER_MODULE, "--store", os.environ[STORE_ENV]]
    return [
        subprocess.Popen(
            [*command, "--prefix", prefix, "--index", str(index)],
            env=env,
            stdin=subprocess.DEVNULL,
        )
        for index in range(spec["servers"])
    ]


def wait_until_ready(
    store: dist.Store,
    prefix: str,
    servers: int,
    processes: list[subprocess.Popen],
    timeout_s: float,
) -> None:
    """Return once every server is up; raise at once, saying why, if one cannot start."""
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [s for s in range(servers) if not store.check([jobkeys.ready_key(prefix, s)])]
        if not missing:
            return
        for s in range(servers):
            said = jobkeys.server_error(store, prefix, s)
            if said:
                raise RuntimeError(f"parameter server {s} could not start:\n{said}")
        for s, process in enumerate(processes):
            if process.poll() is not None and s in missing:
                message = (
                    f"parameter server {s} exited with code {process.returncode} before it "
                    "was ready; its error is printed above."
                )
                store.set(jobkeys.error_key(prefix, s), message)
                raise RuntimeError(message)
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"parameter server(s) {missing} were not ready within {timeout_s:g} s; "
                "raise the timeout on a heavily loaded machine."
            )
        time.sleep(0.05)


def join_group(store: dist.Store, prefix: str, rank: int, size: int, timeout_s: float):
    """This worker's membership of the workers-plus-servers group."""
    return dist.ProcessGroupGloo(
        dist.PrefixStore(jobkeys.group_prefix(prefix), store),
        rank,
        size,
        timedelta(seconds=timeout_s),
    )


def stop_servers(processes: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """Wait for servers that were told goodbye to exit; kill any that do not."""
    deadline = time.monotonic() + grace_s
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5.0)
