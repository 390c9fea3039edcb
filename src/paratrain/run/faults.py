"""Fault injection for tests and drills: a worker killed, or its step raising, at a chosen
point of a chosen step.

``PARATRAIN_FAULT`` holds comma-separated faults
``<kind>:<rank>:<step>[:<phase>[:<attempt>]]``:
``kill`` SIGKILLs the worker (as the out-of-memory killer would), ``crash`` raises in its
step, ``hold`` (phase ``start`` only) waits before the step until a replacement worker is
ready to join, so that a drill of growing back knows the boundary it joins at; ``node``
(under torchrun) SIGKILLs the worker's agent (its parent) and then the worker: a lost node
of one process. ``rank`` is the worker's launch rank (it keeps it when an elastic job
renumbers the survivors).
Phases, in the order a step meets them: ``start`` (before the step, the default),
``forward`` (the model's forward begins), ``backward`` (the first gradient is
ready: the gradient of the last parameter), ``allreduce`` (the last gradient is ready: with
buckets smaller than the model, the earlier buckets' all-reduces are in flight), and
``optimizer`` (the optimizer is about to step: every all-reduce has completed). A fault
fires in one attempt only, the first by default (a restart under ``--max-restarts`` then
runs clean; ``attempt`` 1 fires in the first restart, for drills of several faults).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from dataclasses import dataclass

from paratrain.runtime import comm
from paratrain.runtime.external_job import in_external_job

PHASES = ("start", "forward", "backward", "allreduce", "optimizer")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int
    phase: str

    def fire(self, hold: Callable[[], None] | None = None) -> None:
        if self.kind == "node":  # a lost torchrun node: its agent (our parent), then us
            if not in_external_job():
                raise ValueError("a node fault is for torchrun jobs (it kills the agent).")
            os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "hold":
            if hold is None:
                raise ValueError("a hold fault needs an --elastic run with --max-restarts.")
            hold()
            return
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"injected crash at step {self.step} ({self.phase})")


def launch_rank() -> int:
    """This worker's rank as launched (``RANK``), which elastic renumbering leaves alone."""
    return int(os.environ.get("RANK", comm.rank()))


def planned_faults(attempt: int) -> list[Fault]:
    """This worker's faults from ``PARATRAIN_FAULT`` for this attempt."""
    text = os.environ.get("PARATRAIN_FAULT", "")
    faults = []
    for entry in filter(None, text.split(",")):
        kind, rank, step, *rest = entry.strip().split(":")
        phase = rest[0] if rest else "start"
        bad_hold = kind == "hold" and phase != "start"
        if (
            kind not in ("kill", "crash", "hold", "node")
            or phase not in PHASES
            or len(rest) > 2
            or bad_hold
        ):
            raise ValueError(
                f"PARATRAIN_FAULT entry {entry!r} is not kind:rank:step[:phase[:attempt]]."
            )
        if int(rank) == launch_rank() and int(rest[1] if len(rest) > 1 else 0) == attempt:
            faults.append(Fault(kind, int(rank), int(step), phase))
    return faults


def inject_fault(step: int, attempt: int, hold: Callable[[], None] | None = None) -> None:
    """Fire this worker's ``start`` fault of ``step``, if any (``hold`` waits for a
    replacement, see the module docstring)."""
    for fault in planned_faults(attempt):
        if fault.phase == "start" and fault.step == step:
            fault.fire(hold)


def arm_faults(engine, attempt: int) -> None:
    """Hooks on ``engine``'s model and optimizer that fire this worker's in-step faults.
    The step a hook sees is the one being taken: ``engine.steps_taken + 1``."""
    faults = [f for f in planned_faults(attempt) if f.phase != "start"]
    if not faults:
        return

    def firing(phase: str):
        def hook(*_args, **_kwargs) -> None:
            for fault in faults:
                if fault.phase == phase and fault.step == engine.steps_taken + 1:
                    fault.fire()

        return hook

    parameters = [p for p in engine.model.parameters() if p.requires_grad]
    engine.model.register_forward_pre_hook(firing("forward"))
    parameters[-1].register_post_accumulate_grad_hook(firing("backward"))
    parameters[0].register_post_accumulate_grad_hook(firing("allreduce"))
    engine.optimizer.register_step_pre_hook(firing("optimizer"))
