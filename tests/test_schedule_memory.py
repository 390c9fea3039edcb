"""Each schedule's per-stage activation peak, measured by the memory ledger, against its
theory read off its action list (GPipe m, 1F1B p - s, interleaved its (micro-batch, chunk)
pairs, ZB-H1 2p - 1 - s where its steps end together and the first stage's 2p - 1 on
every stage where they run back to back, and ZB-H2 2p - 1 from F to W).

No tolerance: the ledger counts the storages autograd saves (``ActivationMeter``), every
micro-batch of a step has the same shapes, and the replay sums those same integers in the
list's order, so measured and theory are equal byte for byte; a schedule that held one
micro-batch more or less would differ by a whole pass (over 100 kB here). ZB-H2 under
recompute holds each layer's input instead of its saved tensors: under 60% of the peak
(gpt's blocks save several times their input).
"""

from __future__ import annotations

import pytest

import paratrain
from paratrain.parallel.pipeline.schedules import Action
from tests import schedule_memory_workers
from tests.schedule_memory_workers import SCHEDULES, replayed_peak

MODEL = {"vocab_size": 11, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32}


def test_the_replay_holds_each_pass_from_f_to_its_backward_or_w():
    F, B, W = (lambda m: Action("F", m)), (lambda m: Action("B", m)), (lambda m: Action("W", m))
    sizes = {0: 10, 1: 20}
    assert replayed_peak([F(0), B(0), F(1), B(1)], sizes, split=False) == 20
    assert replayed_peak([F(0), F(1), B(0), B(1)], sizes, split=False) == 30
    assert replayed_peak([F(0), B(0), F(1), W(0), B(1), W(1)], sizes, split=True) == 30


@pytest.mark.slow
def test_each_schedules_measured_peak_is_its_lists_theory_at_two_stages():
    p, m = 2, 8
    settings = [(name, {"stages": p, "micro_batches": m}) for name in SCHEDULES]
    settings.append(("zb-h2", {"stages": p, "micro_batches": m, "recompute": True}))
    # clipping ends every step together: ZB-H1 then runs its flushed lists
    settings.append(("zb-h1", {"stages": p, "micro_batches": m, "max_grad_norm": 1.0}))
    results = paratrain.launch(
        schedule_memory_workers.stage_peaks, devices=2, args=(settings, MODEL, 32)
    )
    expected = {  # the textbook counts on stage s (interleaved: pairs, read off its list)
        "gpipe": lambda s: m,
        "1f1b": lambda s: min(p - s, m),
        # steps back to back: every stage holds the first stage's 2p - 1 (``zb_h1``)
        "zb-h1": lambda s: min(2 * p - 1, m),
        "zb-h2": lambda s: min(2 * p - 1, m),
    }
    for rows in results:
        for name, stage, measured, theory, count, one, _ in rows[:-1]:
            assert measured == theory, (name, stage, measured, theory)
            if name in expected:
                assert count == expected[name](stage), (name, stage, count)
                assert measured == count * one, (name, stage)  # equal passes
        name, stage, measured, theory, count, one, flush = rows[-1]  # ZB-H1, flushed
        assert flush and not any(row[-1] for row in rows[:-1])
        assert measured == theory == count * one and count == min(2 * p - 1 - stage, m)
    first, last = ({name: row for name, *row in rows[:-2]} for rows in results)
    assert first["zb-h2"][1] == first["zb-h1"][1] and last["zb-h2"][1] == last["zb-h1"][1]
    for rows in results:  # recompute: each layer's input held from F to W, not its graph
        plain, recomputed = rows[-3], rows[-2]
        assert recomputed[4] == plain[4] and recomputed[2] < 0.6 * plain[2], (plain, recomputed)
