"""The engine side of the memory ledger: when to measure, and what.

An engine makes a handful of calls and gets a per-worker ledger and a budget check:

    self.memory.watch(params, model_state=..., communication=...)   # end of __init__
    metering = self.memory.begin_step(self.steps_taken)              # after zero_grad
    with self.memory.forward(key): ...                               # each forward
    self.memory.release(key)                                         # after its backward
    self.memory.end_step()                                           # after the optimizer

Why sampled steps: counting saved activations costs a Python call per tensor autograd
saves, and walking the model state costs one per parameter. On the first two steps and
every ``METER_EVERY`` steps after, the tracker measures; in between, each call is a flag
test. The first step is always measured, so a budget that the configuration exceeds fails
on step 1, not 50 steps later; the second is the first to run with everything a step
holds from then on (the optimizer state the first step allocated, gradients kept in
buckets), so a run of two steps has reached its steady peak, the one the planner
predicts. Shapes that grow later (a longer sequence) are caught at the next sampled step.

What is counted, on CPU: parameters, gradients and optimizer state by storage (gradients
that are views into an all-reduce bucket count as gradients; that is where they live);
activations by saved-tensor hooks (``ActivationMeter``), booked at the end of each
forward, when they peak; communication buffers as the engine reports them (bytes held
for messages that are not gradients). Under ``torch.utils.checkpoint`` the hooks see
what a checkpointed segment keeps (its inputs), not the one segment it recomputes at a
time during backward, so the ledger understates a recompute run's peak by about one
segment's activations and their temporaries. The ledger is what the engine books; what a
device holds at every instant is counted independently by ``runtime/live_tensors``, and
the planner predicts that (``parallel/live_cost``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator
from contextlib import contextmanager, nullcontext

import torch

from paratrain.parallel.fit_advice import advice
from paratrain.runtime import comm
from paratrain.runtime.ledger import MemoryLedger, device_budget
from paratrain.runtime.memory import ActivationMeter

METER_EVERY = 50
"""Memory is measured on the first two steps and every this-many steps after."""


def _no_bytes() -> int:
    return 0


class MemoryTracker:
    """Measures one worker's memory into a ``MemoryLedger`` at the points that matter."""

    def __init__(
        self,
        *,
        strategy: str,
        device: torch.device,
        memory_per_device: str | int | None,
        total_parameters: int,
        candidates: Callable[[], Iterable[str]],
        meter_every: int = METER_EVERY,
    ) -> None:
        budget, source = device_budget(memory_per_device, device)
        self.strategy = strategy
        self.total_parameters = total_parameters
        self.meter_every = meter_every
        self.metering = True
        self._steps_seen = 0  # the first two steps this process takes are always measured
        self.activations = ActivationMeter()
        self._candidates = candidates
        self._model_state: Callable[[], dict[str, int]] | None = None
        self._communication: Callable[[], int] = _no_bytes
        self.ledger = MemoryLedger(
            worker=comm.rank(),
            device=device,
            budget=budget,
            budget_source=source,
            advice=self._advise,
        )

    def _advise(self, ledger: MemoryLedger, category: str) -> str:
        clause = advice(
            parameters=self.total_parameters,
            workers=comm.world_size(),
            budget=ledger.budget,
            activations=ledger.peak["activations"],
            candidates=self._candidates(),
            current=self.strategy,
        )
        if category == "activations":
            clause += ", or hold fewer activations (recompute=True, or smaller micro-batches)"
        return clause

    def watch(
        self,
        parameters: Iterable[torch.Tensor],
        *,
        model_state: Callable[[], dict[str, int]],
        communication: Callable[[], int] = _no_bytes,
    ) -> None:
        """Start accounting once the engine holds its model; refuses parameters over budget.

        ``parameters`` are left out of the activation count (matmuls save their weights);
        ``model_state()`` returns parameters/gradients/optimizer bytes, ``communication()``
        the bytes of communication buffers that are not gradients.
        """
        self.activations = ActivationMeter(exclude=list(parameters))
        self._model_state = model_state
        self._communication = communication
        self.account()

    @property
    def watching(self) -> bool:
        """Whether the engine called ``watch`` (and so keeps the ledger up to date)."""
        return self._model_state is not None

    def begin_step(self, step_index: int) -> bool:
        """Decide whether step ``step_index`` (0-based) is measured; book the state if so.
        The first two steps of this process are, whatever their index: a resumed run starts
        at the checkpoint's step, and would otherwise report an unmeasured ledger (0 B) and
        meet its budget up to 49 steps late; the second reaches the steady peak."""
        self.metering = self._steps_seen < 2 or step_index % self.meter_every == 0
        self._steps_seen += 1
        if self.metering:
            self.account()
        return self.metering

    def recording(self, key: Hashable):
        """Count what autograd saves inside the block under ``key`` (measured steps only)."""
        if not self.metering:
            return nullcontext()
        return self.activations.record(key)

    @contextmanager
    def forward(self, key: Hashable) -> Iterator[None]:
        """A forward pass: its saved activations are counted and booked when it ends."""
        if not self.metering:
            yield
            return
        with self.activations.record(key):
            yield
        self.ledger.update(activations=self.activations.current)

    def release(self, key: Hashable) -> None:
        """The backward of ``key`` has run: its activations are gone."""
        if self.metering:
            self.activations.release(key)

    def book_communication(self) -> None:
        """Book the engine's communication buffers now (measured steps only)."""
        if self.metering:
            self.ledger.update(communication=self._communication())

    def end_step(self) -> None:
        """After the optimizer step: book activations left (none) and the model state."""
        if self.metering:
            self.ledger.update(activations=self.activations.current)
            self.account()

    def account(self) -> None:
        """Book parameters, gradients, optimizer state and communication buffers now."""
        if self._model_state is None:
            return
        self.ledger.update(**self._model_state(), communication=self._communication())

    def activation_peak_bytes(self) -> int | None:
        """Peak activation bytes booked so far, or None where activations were never metered."""
        if "activations" not in self.ledger.measured:
            return None
        return self.ledger.peak["activations"]
