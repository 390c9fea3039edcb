"""The pipeline's schedules on a model cut at named split points (Hugging Face GPT-2),
beside a plain training loop, side by side in one run.

The peer: Hugging Face's own model trained by a plain loop (forward with the batch, the
same token loss, backward, optimizer step) in one process on one core, the loop a user
runs before splitting anything. ``torch.distributed.pipelining`` has no runner for such a
model without tracing it into stage modules (its blocks take the masks and position
tensors the model's forward computes), so its schedules are in ``bench_pipeline.py`` on
layer lists instead. Here each of paratrain's schedules runs the model cut at its
repeated blocks over 2 workers (one core each): 1F1B, interleaved 1F1B over 2 virtual
stages, ZB-H1 and ZB-H2, each engine and the plain loop alternating round by round on
the same batches in one launch (the plain loop on rank 0 while rank 1 waits). Reported:
the median step (max over ranks, median over launches), samples/s, each schedule's
samples/s over 1F1B's and over the plain loop's (2 workers: at most 2x, less the bubble
and the messages).

    python benchmarks/bench_split_points.py
    python benchmarks/bench_split_points.py --quick
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from alternation import median_step_times, slowest_rank

import paratrain
from paratrain.losses import causal_lm_cross_entropy

MODEL = {"vocab_size": 512, "n_positions": 128, "n_embd": 256, "n_layer": 8, "n_head": 4}
BATCH, LENGTH, MICRO_BATCHES = 32, 128, 8
SCHEDULES = {
    "1f1b": {},
    "interleaved": {"virtual_stages": 2},
    "zb-h1": {"schedule": "zb-h1"},
    "zb-h2": {"schedule": "zb-h2"},
}
"""Bench name -> the pipeline's options beyond 2 stages and the micro-batches."""
PLAIN = "plain loop"


def build(spec: dict) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        **spec, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(config)


def sgd(params):
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)


def make_batches(
    spec: dict, batch: int, length: int, count: int
) -> list[tuple[dict, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        ids = torch.randint(0, spec["vocab_size"], (batch, length), generator=generator)
        out.append(({"input_ids": ids}, ids))
    return out


class PlainLoop:
    """The model trained as its users train it on one device; rank 0 only."""

    def __init__(self, spec: dict) -> None:
        self.model = build(spec) if dist.get_rank() == 0 else None
        self.optimizer = sgd(self.model.parameters()) if self.model is not None else None

    def step(self, inputs: dict, labels: torch.Tensor) -> None:
        if self.model is None:
            return
        self.optimizer.zero_grad(set_to_none=True)
        total, count = causal_lm_cross_entropy(self.model(**inputs), labels)
        (total / count).backward()
        self.optimizer.step()


class Engine:
    def __init__(self, spec: dict, micro: int, options: dict) -> None:
        self.engine = paratrain.setup(
            build(spec),
            optimizer=sgd,
            loss_fn=causal_lm_cross_entropy,
            strategy="pipeline",
            stages=2,
            micro_batches=micro,
            **options,
        )

    def step(self, inputs: dict, labels: torch.Tensor) -> None:
        self.engine.train_step(inputs, labels)


def bench_worker(
    spec: dict, shape: tuple[int, int, int], schedules: list[str], rounds: int, steps: int
) -> dict:
    batch, length, micro = shape
    runners = {PLAIN: PlainLoop(spec)}
    runners.update({name: Engine(spec, micro, SCHEDULES[name]) for name in schedules})
    batches = make_batches(spec, batch, length, steps)
    return median_step_times(runners, batches, rounds=rounds, warmup=min(2, steps))


def run(
    spec: dict,
    shape: tuple[int, int, int],
    schedules: list[str],
    rounds: int,
    steps: int,
    repeats: int,
) -> list[dict]:
    """One row per runner: median step over launches, samples/s, ratios per launch."""
    launches = [
        slowest_rank(
            paratrain.launch(bench_worker, devices=2, args=(spec, shape, schedules, rounds, steps))
        )
        for _ in range(repeats)
    ]
    batch = shape[0]
    rows = []
    for name in [PLAIN, *schedules]:
        over_plain = [launch[PLAIN] / launch[name] for launch in launches]
        over_1f1b = (
            [launch["1f1b"] / launch[name] for launch in launches] if "1f1b" in schedules else []
        )
        step = statistics.median(launch[name] for launch in launches)
        rows.append(
            {
                "runner": name,
                "median_step_s": step,
                "samples_per_s": batch / step,
                "over_plain_loop": statistics.median(over_plain),
                "over_plain_loop_range": [min(over_plain), max(over_plain)],
                "over_1f1b": statistics.median(over_1f1b) if over_1f1b else None,
                "over_1f1b_range": [min(over_1f1b), max(over_1f1b)] if over_1f1b else None,
            }
        )
    return rows


HEADER = (
    "| runner | step ms | samples/s | over the plain loop (range) | over 1F1B (range) |\n"
    "|---|---|---|---|---|"
)


def _ratio(median: float | None, span: list[float] | None) -> str:
    if median is None:
        return "-"
    return f"{median:.2f} ({span[0]:.2f}-{span[1]:.2f})"


def format_row(row: dict) -> str:
    where = "1 process" if row["runner"] == PLAIN else "2 stages"
    return (
        f"| {row['runner']} ({where}) | {row['median_step_s'] * 1e3:.1f} "
        f"| {row['samples_per_s']:.1f} "
        f"| {_ratio(row['over_plain_loop'], row['over_plain_loop_range'])} "
        f"| {_ratio(row['over_1f1b'], row['over_1f1b_range'])} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="launches")
    parser.add_argument(
        "--quick", action="store_true", help="a small model, 1 launch of 1 round x 2 steps"
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    spec, shape = dict(MODEL), (BATCH, LENGTH, MICRO_BATCHES)
    rounds, steps, repeats = args.rounds, args.steps, args.repeats
    if args.quick:
        spec.update(n_positions=32, n_embd=64, n_layer=4)
        shape, (rounds, steps, repeats) = (8, 32, 4), (1, 2, 1)
    print(
        f"torch {torch.__version__}, GPT-2 {spec}, batch {shape[0]} x {shape[1]} tokens, "
        f"{shape[2]} micro-batches; {repeats} launch(es) x {rounds} rounds x {steps} steps"
    )
    rows = run(spec, shape, args.schedules, rounds, steps, repeats)
    print(HEADER)
    print("\n".join(format_row(row) for row in rows), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
