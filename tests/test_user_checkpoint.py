"""A user's own activation checkpointing (``torch.utils.checkpoint`` inside their layers,
as Hugging Face's ``gradient_checkpointing_enable()`` sets up) under every strategy.

``use_reentrant=False`` trains as the plain loop everywhere, the zero-bubble schedules
included (B and W each rerun the checkpointed forward as they need it). With
``use_reentrant=True`` the checkpoint's backward calls a whole backward of its own, which
torch refuses under ``autograd.grad``, and so under a split backward's B: the whole
backward of dp, ZeRO, GPipe, 1F1B and interleaved trains as the plain loop, and the
zero-bubble schedules stop with one sentence saying what to change
(``pipeline/split_backward_limits``), where before they stopped with torch's own words
about ``.grad()`` deep inside the engine.

Tolerance: the suite's (``TOLERANCE``, 1e-5 relative per parameter): a checkpoint reruns
the same forward on the same inputs, so the engines differ from the plain loop only in
the order of fp32 sums, about 1e-7 relative a step over these 10 steps.
"""

from __future__ import annotations

import pytest

import paratrain
from paratrain.models import loss_for
from paratrain.runtime.launch import WorkerError
from tests import user_checkpoint_workers as checkpointed
from tests import workers
from tests.schedule_memory_workers import SCHEDULES
from tests.test_parity_dp import TOLERANCE, relative_error

PIPELINE = {"strategy": "pipeline", "stages": 2, "micro_batches": 4}
WHOLE_BACKWARD = [
    {"strategy": "dp"},
    {"strategy": "zero3"},
    *({**PIPELINE, **SCHEDULES[name]} for name in ("gpipe", "1f1b", "interleaved")),
]


def plain_loop(optimizer: str) -> dict:
    model, batches = checkpointed.checkpointed_layers(None), workers.parity_batches("mlp")
    return workers.plain_loop_state(model, optimizer, batches, loss_for("mlp"))


def check(runs: list[tuple[bool, str, dict]]) -> None:
    states = paratrain.launch(checkpointed.checkpointed_worker, devices=2, args=(runs,))[0]
    plain = {name: plain_loop(name) for name in ("sgd", "adam")}
    for (reentrant, optimizer, options), state in zip(runs, states, strict=True):
        error = relative_error(state, plain[optimizer])
        label = f"use_reentrant={reentrant}, {optimizer}, {options}"
        assert error <= TOLERANCE, f"{label}: relative error {error:.2e}"


@pytest.mark.slow
def test_non_reentrant_checkpoints_train_as_the_plain_loop_under_every_strategy():
    """dp, ZeRO-3 and every schedule at 2 workers (ZB-H1 also under paratrain's own
    recompute, a checkpoint around the user's), SGD-momentum and Adam."""
    options = [
        *WHOLE_BACKWARD,
        {**PIPELINE, "schedule": "zb-h1"},
        {**PIPELINE, "schedule": "zb-h2"},
    ]
    options.append({**PIPELINE, "schedule": "zb-h1", "recompute": True})
    check([(False, name, option) for option in options for name in ("sgd", "adam")])


@pytest.mark.slow
def test_reentrant_checkpoints_train_where_the_backward_is_whole():
    """dp, ZeRO-3, GPipe, 1F1B and interleaved 1F1B: one backward, as torch allows."""
    check([(True, "adam", option) for option in WHOLE_BACKWARD])


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["zb-h1", "zb-h2"])
def test_reentrant_checkpoints_under_zero_bubble_say_what_to_change(schedule):
    """The stage whose B meets the checkpoint fails with what to change; the launcher
    stops the other (waiting for that stage's gradient) at once."""
    runs = [(True, "adam", {**PIPELINE, "schedule": schedule})]
    with pytest.raises(WorkerError, match=r"use_reentrant=False \(Hugging Face"):
        paratrain.launch(checkpointed.checkpointed_worker, devices=2, args=(runs,))
