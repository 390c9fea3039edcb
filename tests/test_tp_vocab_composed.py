"""The vocabulary-split embedding and lm head (issue 25) composed with the engines that
hold a tensor group inside another degree: zero1 and zero2 at 2 replicas x tensor 2, and
the pipeline at 2 stages x tensor 2 (gpt as a layer list: its embedding on the first
stage, its head on the last; tied, the tie crosses the stages), padded labels (-100 on
uneven rows), SGD-momentum and AdamW, against one process.

Tolerance: ``VOCAB_TOLERANCE`` of tests/test_tp_vocab.py, derived there (three reordered
sums over ``V`` logits per step, plus the replicas' all-reduce that tests/test_parity_dp.py
bounds). ZeRO adds no sum of its own: the reduce-scatter adds the same two replicas' parts
an all-reduce adds, and each shard's update is the optimizer's per-element arithmetic. The
pipeline's reference takes the same 2 micro-batches as 2 accumulated parts
(``gradient_accumulation=2``), and a tie crossing the stages adds the embedding's and the
head's gradient of a row once more, in another order: one more rounding of the sum of two
terms, within ``TOLERANCE``. Measured (states, relative): 4.5e-7 and below with SGD,
up to 7.8e-6 with AdamW (gpt under the pipeline); losses 2.3e-7 and below. A run that
trained nothing is ~1e-3 or more off (checked); before the pipeline read its ties from
the unsplit model, tied gpt under it ended 0.21 off.
"""

from __future__ import annotations

import pytest

import paratrain
from tests import vocab_workers
from tests.test_tp_vocab import VOCAB_TOLERANCE, assert_trains_as_one_process

pytest.importorskip("transformers", reason="the dev extra installs transformers")

ZERO = [
    ("gpt", "sgd", "summed", {"strategy": "zero1", "tensor": 2}),
    ("gpt_tied", "adam", "summed", {"strategy": "zero1", "tensor": 2}),
    ("llama", "adam", "summed", {"strategy": "zero1", "tensor": 2}),
    ("gpt", "adam", "summed", {"strategy": "zero2", "tensor": 2}),
    ("gpt_tied", "sgd", "summed", {"strategy": "zero2", "tensor": 2}),
    ("gpt2", "sgd", "summed", {"strategy": "zero2", "tensor": 2}),
]
"""(model, optimizer, loss form, options) on 4 workers: 2 replicas x tensor 2. The
(sum, count) loss only: a per-replica mean (gpt's ``sequence_cross_entropy``) is not the
whole batch's mean once replicas hold uneven token counts, split head or not
(``paratrain.losses``), so one process is no reference for it."""
PIPELINE = {"strategy": "pipeline", "stages": 2, "tensor": 2, "micro_batches": 2}
STAGES = [
    ("gpt", "sgd", "summed", PIPELINE),
    ("gpt", "adam", "summed", PIPELINE),
    ("gpt_tied", "sgd", "summed", PIPELINE),
    ("gpt_tied", "adam", "summed", PIPELINE),
]
"""gpt's layer list on 4 workers: 2 stages x tensor 2, 2 micro-batches (1F1B)."""


GATHER_LINE = "a tally reads whole logits: the vocab-split lm head gathers them"


def _gathers_for_a_tally(run: tuple, evaluated: tuple, head_here: bool) -> None:
    """A tally reads whole logits: the head gathers them once one is open (where this
    rank holds it), and the eval loss is the split one's within the same bound."""
    split, whole, gather = evaluated
    assert gather is (True if head_here else None), (run, evaluated)
    assert abs(split - whole) <= VOCAB_TOLERANCE * abs(split), (run, evaluated)


@pytest.mark.slow
def test_vocab_split_under_zero1_and_zero2_by_tensor_trains_as_one_process(capfd):
    ranks = paratrain.launch(vocab_workers.composed_worker, devices=4, args=(ZERO,))
    assert capfd.readouterr().out.count(GATHER_LINE) == len(ZERO)  # said once a run
    for index, run in enumerate(ZERO):
        state, losses, held, evaluated = ranks[0][index]
        rows = vocab_workers.VOCAB // 2
        assert held["rows"] == held["embedding_rows"] == rows, run
        assert held["tied"] == (run[0] in ("gpt_tied", "gpt2")), run
        assert held["gather"] is False, (run, held)  # the logits stay split
        _gathers_for_a_tally(run, evaluated, head_here=True)
        assert_trains_as_one_process(run, state, losses)


@pytest.mark.slow
def test_vocab_split_under_pipeline_by_tensor_trains_as_one_process(capfd):
    """Ranks 0-1 are the first stage's tensor group (the embedding's rows), 2-3 the
    last's (the head's rows, its logits kept split by the loss); the line a tally's
    gather prints comes from the last stage (rank 0 holds no head), once a run."""
    ranks = paratrain.launch(vocab_workers.composed_worker, devices=4, args=(STAGES,))
    assert capfd.readouterr().out.count(GATHER_LINE) == len(STAGES)
    rows = vocab_workers.VOCAB // 2
    for index, run in enumerate(STAGES):
        for rank in (0, 1):
            held = ranks[rank][index][2]
            assert held["embedding_rows"] == rows and held["rows"] is None, (run, held)
        for rank in (2, 3):
            held = ranks[rank][index][2]
            assert held["rows"] == rows and held["embedding_rows"] is None, (run, held)
            assert held["gather"] is False, (run, held)
        for rank in range(4):
            _gathers_for_a_tally(run, ranks[rank][index][3], head_here=rank >= 2)
        state, losses, _, _ = ranks[0][index]
        assert_trains_as_one_process(run, state, losses)
