"""Per-stage peak activation memory of every pipeline schedule: measured by the memory
ledger, side by side with the schedule's theory read off its own action list.

Theory, per stage: each pass's saved bytes held from its F to its backward (to its W where
the backward is split into B and W), replayed in the list's order; the in-flight count
beside it is ``schedules.max_in_flight`` (GPipe m, 1F1B min(p - s, m), interleaved
(micro-batch, chunk) pairs, ZB-H1 min(2p - 1 - s, m) where its steps end together, else
up to the most any stage holds so, ZB-H2 min(2p - 1, m)). Measured: the
ledger's activation peak over two steps (``engine.activation_peak_bytes``). gpt, global
batch 32, m = 8; 2 stages on 2 workers, 4 stages on 4; ZB-H2 also under recompute. The
ledger counts what autograd saves; the output gradients B keeps for W are not saved
tensors and are not in it.

    python benchmarks/bench_schedule_memory.py            # 2 and 4 stages
    python benchmarks/bench_schedule_memory.py --stages 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import paratrain  # noqa: E402
from tests.schedule_memory_workers import SCHEDULES, TEXTBOOK, stage_peaks  # noqa: E402

MODEL = {"vocab_size": 11, "block_size": 16, "n_layer": 6, "n_head": 2, "n_embd": 32}
BATCH, MICRO = 32, 8


def rows(stages: int) -> list[str]:
    """The table's rows for ``stages`` stages (one launch, every schedule, and ZB-H2 under
    recompute: each layer's input held from F to W)."""
    settings = [(name, {"stages": stages, "micro_batches": MICRO}) for name in SCHEDULES]
    settings.append(("zb-h2", {"stages": stages, "micro_batches": MICRO, "recompute": True}))
    labels = [name + (" recompute" if opts.get("recompute") else "") for name, opts in settings]
    results = paratrain.launch(stage_peaks, devices=stages, args=(settings, MODEL, BATCH))
    by_label: dict[str, list[tuple]] = {label: [] for label in labels}
    for worker in results:
        for label, (_, stage, measured, theory, count, one, flush) in zip(
            labels, worker, strict=True
        ):
            by_label[label].append((stage, measured, theory, count, one, flush))
    out = []
    for label, stage_rows in by_label.items():
        name = label.split()[0]
        for stage, measured, theory, count, one, flush in sorted(stage_rows):
            # ZB-H1's lists for steps that do not end together (no clipping here)
            textbook = TEXTBOOK[name if flush or name != "zb-h1" else "zb-h1 back to back"]
            out.append(
                f"| {stages} x {MICRO} | {label} | {stage} | {textbook} | {count} | "
                f"{one / 1024:.1f} | {theory / 1024:.1f} | {measured / 1024:.1f} | "
                f"{measured / theory:.3f} |"
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    print(
        "| stages x micro | schedule | stage | in flight (docs) | in flight (its list) | "
        "largest pass KiB | theory KiB | measured KiB | measured/theory |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for stages in args.stages:
        for row in rows(stages):
            print(row, flush=True)


if __name__ == "__main__":
    main()
