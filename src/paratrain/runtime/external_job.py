"""Running inside a job that someone else started (torchrun, Slurm + torchrun).

Why a contract of its own: a local ``launch`` has one parent process that gets every
rank's return value, while under torchrun every rank runs the whole script. A script must
be able to rely on one shape in both modes, so ``launch`` returns a list of
``world_size`` entries in both: locally every entry is filled; under torchrun the values
are gathered to global rank 0 (which gets the full list, as a local parent does) and
every other rank gets its own entry with ``None`` in the others' places. Gathering to one
rank rather than to all keeps a job of N ranks returning N state dicts from holding N^2
copies. ``is_main_process()`` says where once-per-job work (saving, printing) belongs.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from paratrain.runtime.devices import process_group_backend

CHILD_FLAG = "PARATRAIN_LAUNCHED_WORKER"

T = TypeVar("T")

_joined_here = False
"""True while the job's group is one that ``join_job`` made (``run_in_external_job``
destroys it, as it does a group it made itself)."""


def in_external_job() -> bool:
    """True inside a job started by torchrun/Slurm (not one of our own workers)."""
    if os.environ.get(CHILD_FLAG):
        return False
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    )


def job_world_size() -> int:
    """The number of processes in the external job."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main_process() -> bool:
    """True in the one process of a job that should save, print or plot once.

    That is the process that called ``launch`` locally (or any process outside a job), and
    global rank 0 under torchrun; inside a worker it is rank 0.
    """
    return int(os.environ.get("RANK", "0")) == 0


def check_job_devices(devices: int | None) -> None:
    """Refuse a device count that contradicts the job's size rather than ignore it."""
    world = job_world_size()
    if devices is not None and devices != world:
        raise ValueError(
            f"devices={devices} was asked for inside a torchrun job of {world} processes, "
            f"and the job's size decides; drop devices (or pass --devices {world}), or "
            f"start torchrun with {devices} processes in all."
        )


def run_in_external_job(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    backend: str,
    timeout_s: float,
    resolve_backend: Callable[[str, int], str],
) -> list[Any]:
    """Join the job's process group (if the script has not), run ``fn`` here, and gather
    the values to rank 0 as the module docstring says.

    A group this function created is destroyed before it returns, after every rank has
    its values: left to interpreter exit, gloo's worker threads are torn down with the
    interpreter and the process can die of SIGABRT ("terminate called without an active
    exception") after its work is done. A group the script created is the script's to
    destroy. Nothing is destroyed when ``fn`` raises: a rank that failed must not wait in
    a collective teardown on ranks that are still training."""
    join_job(backend, timeout_s, resolve_backend)
    owned = _joined_here  # made by this call or by an earlier join_job
    value = fn(*args, **kwargs)
    rank, world = dist.get_rank(), dist.get_world_size()
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(value, gathered, dst=0)
    if owned:
        # The engine ``fn`` built sits in reference cycles (its hooks close over it) that
        # hold its subgroups; collected now, they are freed with the interpreter alive.
        gc.collect()
        leave_job()
    if rank == 0:
        return gathered
    own: list[Any] = [None] * world
    own[rank] = value
    return own


def join_job(backend: str, timeout_s: float, resolve_backend: Callable[[str, int], str]) -> bool:
    """Join the job's process group unless this process is in it already; True if this
    call made it (then ``run_in_external_job`` or ``leave_job`` destroys it)."""
    global _joined_here
    if dist.is_initialized():
        return False
    world = job_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    resolved = resolve_backend(backend, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    if resolved == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(process_group_backend(resolved), timeout=timedelta(seconds=timeout_s))
    _joined_here = True
    return True


def leave_job() -> None:
    """Destroy the group ``join_job`` made, once every rank has arrived (no rank leaves
    while another is still receiving); nothing where the script made the group."""
    global _joined_here
    if _joined_here and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    _joined_here = False


def decided_once(decide: Callable[[], T]) -> T:
    """``decide()`` run on rank 0 alone and its value (or its exception) given to every
    rank, so that what must agree across ranks (a run folder named from a clock) does.

    Outside a job (no group) it is simply ``decide()``. Inside one the group must exist
    (``join_job``); the value travels by ``broadcast_object_list`` over the group, never
    through a file. Every rank raises rank 0's exception, so all refuse alike."""
    if not dist.is_initialized():
        return decide()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = (True, decide())
        except Exception as error:  # every rank raises it below
            box[0] = (False, error)
    dist.broadcast_object_list(box, src=0)
    ok, value = box[0]
    if not ok:
        raise value
    return value
