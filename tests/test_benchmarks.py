"""The benchmark scripts still run (tiny settings; no timing is asserted here)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.slow
def test_bench_dp_counts_exactly_the_gradient_bytes_plus_the_loss_slot(monkeypatch):
    # On sys.path (not loaded from a file path) so spawned workers can import it too.
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = importlib.import_module("bench_dp")
    rows = bench.run(["gpt"], [2], rounds=1, steps=2, options={}, repeats=1)
    row = rows[0]
    assert set(row["median_step_s"]) == {"ddp", "paratrain"}
    gradient_bytes = row["ring_optimum_bytes"] / (2 * (2 - 1) / 2)
    assert row["allreduce_payload_bytes"] == gradient_bytes + 4  # one fp32 loss slot
    assert "| gpt | 2 |" in bench.format_row(row)


@pytest.mark.slow
def test_bench_pipeline_runs_both_sides_and_measures_the_bubble(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = importlib.import_module("bench_pipeline")
    monkeypatch.setitem(
        bench.MODELS,
        "mlp",
        {
            "options": {"in_features": 16, "hidden": 16, "depth": 2, "classes": 4},
            "global_batch": 32,
        },
    )
    rows = bench.run(["mlp"], [2], ["1f1b"], rounds=1, steps=2, repeats=1)
    row = rows[0]
    assert set(row["median_step_s"]) == {"paratrain", "torch"}
    assert row["micro_batches"] == 8 and sum(row["balance"]) == 6
    assert 0.0 < row["bubble_measured"] < 1.0
    assert row["bubble_theory"] == pytest.approx(1 / 9)
    assert "| mlp | 2 x 8 | 1f1b |" in bench.format_row(row)
