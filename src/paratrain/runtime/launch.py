"""Start N local worker processes (or join a torchrun job) and bring back what they return.

Why our own launcher rather than ``torch.multiprocessing.spawn``: we want three things
spawn does not give together. (1) The rendezvous store lives in the parent on a port the
OS picked, so two runs on one machine never race for a port. (2) The first worker that
fails stops every other one within seconds, and the caller gets that worker's rank and
original traceback, not the secondary "connection closed" errors of its peers. (3) Return
values, tensors included, come back intact and in rank order.
"""

from __future__ import annotations

import io
import os
import queue as queue_module
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from paratrain.runtime.devices import process_group_backend
from paratrain.runtime.elastic import JOINING_ENV, PEER_GONE_MARKERS, ElasticReferee
from paratrain.runtime.external_job import (
    CHILD_FLAG,
    check_job_devices,
    in_external_job,
    job_world_size,
    run_in_external_job,
)
from paratrain.runtime.hang import STORE_ENV
from paratrain.runtime.parent_death import launcher_pid_exported
from paratrain.runtime.signals import forwarding_termination, ignore_interrupts
from paratrain.runtime.worker_start import DeferredCall, WorkerPreparation, worker_start

DEFAULT_TIMEOUT_S = 300.0
BACKENDS = ("auto", "gloo", "nccl")
_COMM_ERROR_MARKERS = ("DistBackendError", *PEER_GONE_MARKERS)
TOLERATE_LOST_WORKERS_KEY = "paratrain/launch/tolerate_lost_workers"


class WorkerError(RuntimeError):
    """A worker process raised or died; carries the failing rank and its traceback."""

    def __init__(self, rank: int, details: str, *, failures: dict[int, str] | None = None):
        self.rank = rank
        self.details = details
        self.failures = failures or {rank: details}
        self.terminated = False  # True where the run had been sent SIGTERM (see signals)
        super().__init__(f"worker {rank} failed:\n{details}")


@dataclass(frozen=True)
class LostWorker:
    """What ``launch`` returns for a worker that died in a job that goes on without it."""

    rank: int
    reason: str


def tolerate_lost_workers(store: dist.Store) -> None:
    """Mark the running job as one that goes on when a worker dies (called by a worker).

    For engines whose workers never wait on one another (ps): ``launch`` then records a
    worker killed by a signal, or gone without a result, as a ``LostWorker`` in its place
    in the results and lets the others finish. A worker that raises still stops everyone,
    and so does losing every worker.
    """
    store.set(TOLERATE_LOST_WORKERS_KEY, "1")


@dataclass(frozen=True)
class _WorkerSpec:
    host: str
    store_port: int
    world_size: int
    backend: str
    timeout_s: float
    threads: int
    preparation: WorkerPreparation  # what a worker is given first (see worker_start)


def thread_share(devices: int) -> int:
    """The intra-op threads ``launch`` gives each of ``devices`` local workers unless
    told otherwise: this machine's cores shared out, at least one."""
    return max(1, (os.cpu_count() or 1) // devices)


def default_device_count() -> int:
    """The job's size inside torchrun; else GPUs where there are any; otherwise as many
    CPU workers as cores, at most 4."""
    if in_external_job():
        return job_world_size()
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return max(1, min(4, os.cpu_count() or 1))


def resolve_backend(backend: str, devices: int) -> str:
    """'auto' picks NCCL when every worker can have its own GPU, gloo otherwise."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', not {backend!r}.")
    if backend == "auto":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return "nccl" if gpus >= devices else "gloo"
    if backend == "nccl" and (not torch.cuda.is_available() or torch.cuda.device_count() < devices):
        raise ValueError(
            f"backend='nccl' needs one GPU per worker, but {devices} workers were asked for "
            f"and {torch.cuda.device_count()} GPU(s) are visible; "
            "use backend='gloo' or fewer devices."
        )
    return backend


def launch(
    fn: Callable[..., Any],
    *,
    devices: int | None = None,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    backend: str = "auto",
    host: str = "127.0.0.1",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    threads_per_worker: int | None = None,
) -> Any:
    """Run ``fn(*args, **kwargs)`` in ``devices`` worker processes joined in one process group.

    Returns the list of every rank's return value, in rank order. Inside a torchrun/Slurm
    job it instead initialises the process group from the environment (if needed), runs
    ``fn`` in this process, and returns a list of the same length: full on global rank 0,
    this rank's own entry (others ``None``) elsewhere (see ``external_job``).
    """
    kwargs = dict(kwargs or {})
    if in_external_job():
        check_job_devices(devices)
        return run_in_external_job(fn, args, kwargs, backend, timeout_s, resolve_backend)
    devices = _checked_devices(fn, devices, timeout_s)
    resolved = resolve_backend(backend, devices)
    threads = threads_per_worker or thread_share(devices)
    store = dist.TCPStore(
        host,
        0,
        devices,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
    )
    start = worker_start()
    spec = _WorkerSpec(host, store.port, devices, resolved, timeout_s, threads, start.preparation)
    call = DeferredCall(fn, tuple(args), kwargs)
    results_queue = start.context.Queue()

    def process(rank: int, joining: bool = False):
        return start.context.Process(
            target=_worker_main,
            args=(rank, spec, call, results_queue, joining),
            name=f"paratrain-worker-{rank}",
        )

    processes = [process(rank) for rank in range(devices)]

    def spawn_replacement(rank: int) -> None:
        """An elastic job's replacement worker (see ``runtime/elastic``), started now."""
        processes.append(process(rank, joining=True))
        with launcher_pid_exported():
            processes[-1].start()

    try:
        with forwarding_termination(processes) as terminated:
            with launcher_pid_exported():  # each worker dies with this process (see there)
                for worker in processes:
                    worker.start()
            try:
                results = _collect(processes, results_queue, store, spawn_replacement)
            except WorkerError as error:
                error.terminated = terminated[0]  # died of a forwarded SIGTERM, perhaps
                raise
        _join_all(processes, timeout_s=10.0)
        return results
    except KeyboardInterrupt:
        _stop_all(processes, grace_s=0.0)  # Ctrl-C: stop now, no checkpoint (see signals)
        raise
    finally:
        _stop_all(processes)
        results_queue.close()
        del store


def _checked_devices(fn: Callable[..., Any], devices: int | None, timeout_s: float) -> int:
    """How many local workers to start; what cannot run is refused before any starts."""
    if devices is None:
        devices = default_device_count()
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be a positive integer, not {devices!r}.")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, not {timeout_s!r}.")
    if not callable(fn):
        raise TypeError("launch needs a callable as its first argument.")
    return devices


def _collect(processes: list, results_queue, store=None, spawn=None) -> list[Any]:
    """Wait for every rank's result; on the first failure stop everyone and raise.

    In a job marked by ``tolerate_lost_workers``, a worker that died is recorded as lost
    instead, and the others go on; in an elastic one the referee decides (and ``spawn``
    adds replacements to ``processes``).
    """
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    lost: dict[int, str] = {}
    first_failure_at: float | None = None
    exited_without_result: dict[int, float] = {}
    referee = ElasticReferee(len(processes), spawn)
    unneeded: set[int] = set()  # replacements the run ended without (see the referee)
    while len(results) + len(lost) + len(unneeded) < len(processes):
        if first_failure_at is not None and time.monotonic() - first_failure_at > 1.0:
            break
        try:
            kind, rank, payload = results_queue.get(timeout=0.05)
        except queue_module.Empty:
            before = set(failures)
            done = {**results, **lost, **dict.fromkeys(unneeded)}
            _note_dead_workers(processes, done, failures, exited_without_result)
            deaths = set(failures) - before
            if deaths and store is not None and store.check([TOLERATE_LOST_WORKERS_KEY]):
                for rank in sorted(deaths):
                    lost[rank] = failures.pop(rank)
                    print(f"paratrain: {lost[rank]} The job goes on without it.", file=sys.stderr)
            elif deaths and store is not None:
                referee.settle(store, deaths, failures, lost)
            if results and referee.pending and store is not None:
                for rank in referee.unneeded(store, set(results)):
                    _stop_all([processes[rank]], grace_s=0.0)
                    unneeded.add(rank)
            if failures and first_failure_at is None:
                first_failure_at = time.monotonic()
            continue
        if kind == "ok":
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        else:
            failures.setdefault(rank, payload)
            if first_failure_at is None:
                first_failure_at = time.monotonic()
    if failures:
        _stop_all(processes)
        rank = _root_cause(failures)
        raise WorkerError(rank, failures[rank], failures=failures)
    if not results:
        rank = min(lost)
        raise WorkerError(rank, f"every worker was lost; the first: {lost[rank]}", failures=lost)
    return [
        results[r] if r in results else LostWorker(r, lost[r])
        for r in range(len(processes))
        if r not in unneeded
    ]


def _note_dead_workers(processes, results, failures, exited_without_result) -> None:
    """A worker that exited without sending a result has failed (a kill, a segfault...)."""
    now = time.monotonic()
    for rank, process in enumerate(processes):
        code = process.exitcode
        if code is None or rank in results or rank in failures:
            continue
        # Give a result still in flight through the pipe a moment to arrive.
        seen = exited_without_result.setdefault(rank, now)
        if code == 0 and now - seen < 2.0:
            continue
        if code != 0 and now - seen < 0.3:
            continue
        if code < 0:
            name = signal.Signals(-code).name
            failures[rank] = f"worker process {rank} was killed by signal {name} (no traceback)."
        else:
            failures[rank] = f"worker process {rank} exited with code {code} without a result."


def dead_ranks(error: WorkerError) -> list[int]:
    """The ranks of ``error`` that failed themselves (died, or raised), not those whose
    collective failed because another went away."""
    return sorted(
        rank
        for rank, details in error.failures.items()
        if not any(marker in details for marker in _COMM_ERROR_MARKERS)
    )


def _root_cause(failures: dict[int, str]) -> int:
    """Prefer the rank whose error is not just a peer noticing that another rank went away."""
    for rank in sorted(failures):
        if not any(marker in failures[rank] for marker in _COMM_ERROR_MARKERS):
            return rank
    return min(failures)


def _stop_all(processes: list, grace_s: float = 3.0) -> None:
    """SIGTERM every live worker, then SIGKILL what is left after the grace period."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + grace_s
    for process in processes:
        if process.pid is None:
            continue
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join(1.0)


def _join_all(processes: list, timeout_s: float) -> None:
    """Let workers that already sent their result finish their own clean-up."""
    deadline = time.monotonic() + timeout_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))


def _join_group(rank: int, spec: _WorkerSpec) -> None:
    timeout = timedelta(seconds=spec.timeout_s)
    store = dist.TCPStore(
        spec.host, spec.store_port, spec.world_size, is_master=False, timeout=timeout
    )
    dist.init_process_group(
        process_group_backend(spec.backend),
        store=store,
        rank=rank,
        world_size=spec.world_size,
        timeout=timeout,
    )


def _worker_main(
    rank: int, spec: _WorkerSpec, call: DeferredCall, results_queue, joining: bool = False
) -> None:
    """One worker: its group (a replacement joining an elastic job forms its own later,
    see ``runtime/elastic``), ``fn``, and its result or traceback on the queue."""
    spec.preparation.apply()  # what a spawned interpreter would have had
    ignore_interrupts()
    os.environ.update(
        {
            CHILD_FLAG: "1",
            STORE_ENV: f"{spec.host}:{spec.store_port}",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(spec.world_size),
            "LOCAL_WORLD_SIZE": str(spec.world_size),
            "MASTER_ADDR": spec.host,
            **({JOINING_ENV: "1"} if joining else {}),
        }
    )
    torch.set_num_threads(spec.threads)
    try:
        if spec.backend == "nccl":
            torch.cuda.set_device(rank)
        fn, args, kwargs = call.load()
        if not joining:
            _join_group(rank, spec)
        value = fn(*args, **kwargs)
        # The work is done and its report must reach the launcher: a scheduler's SIGTERM
        # (or the launcher's forwarded copy) landing now would lose a run that finished
        # (see signals.py); the launcher still SIGKILLs a worker that outstays its grace.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results_queue.put(("ok", rank, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        results_queue.put(("error", rank, traceback.format_exc()))
        results_queue.close()
        results_queue.join_thread()
        os._exit(1)
    results_queue.close()
    results_queue.join_thread()
    if dist.is_initialized():
        dist.destroy_process_group()
