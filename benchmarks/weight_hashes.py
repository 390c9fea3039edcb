"""Final-weight hashes of every engine on the four parity cases: a refactor's witness.

A change that means to keep behaviour (moving code, composing engines from steps) must
leave every engine's final weights bit-identical: run this before and after and compare
the printed lines (``diff``). The cases are the parity suite's (``tests/workers.py``):
mlp and gpt, SGD-momentum and Adam, 10 steps of a 16-sample global batch, at 2 workers
(tp and tensor splits at 2, the pipeline 2 stages x 4 micro-batches under GPipe and 1F1B,
ps synchronous: staleness 0).

    python benchmarks/weight_hashes.py > before.txt   # on the old commit
    python benchmarks/weight_hashes.py > after.txt    # on the new one
    diff before.txt after.txt
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import paratrain  # noqa: E402
from tests import workers  # noqa: E402

CASES = [(kind, optimizer, 1) for kind in ("mlp", "gpt") for optimizer in ("sgd", "adam")]
RUNS = [
    ("single", {}),
    ("dp", {}),
    ("zero1", {}),
    ("zero2", {}),
    ("zero2", {"shard_copies": True}),  # the copies change nothing of the step: zero2's hashes
    ("zero3", {}),
    ("pipeline", {"stages": 2, "micro_batches": 4, "schedule": "gpipe"}),
    ("pipeline", {"stages": 2, "micro_batches": 4, "schedule": "1f1b"}),
    ("tp", {}),
    ("ps", {"staleness": 0}),
]


def digest(state: dict) -> str:
    """SHA-256 over the canonical names and the exact bytes of every tensor, name order."""
    sha = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().contiguous().cpu()
        sha.update(name.encode())
        sha.update(str(tuple(tensor.shape)).encode())
        sha.update(tensor.numpy().tobytes())
    return sha.hexdigest()[:16]


def hashes_worker(strategy: str, options: dict) -> list[str]:
    """Every case under one strategy; each rank returns its hashes (rank 0's are printed)."""
    out = []
    for case in CASES:
        state, losses = workers.train_with(strategy, *case, **options)
        out.append(digest(state) if state else "")
    return out


def main() -> None:
    for strategy, options in RUNS:
        if strategy == "single":
            results = [hashes_worker(strategy, options)]
        else:
            results = paratrain.launch(hashes_worker, devices=2, args=(strategy, options))
        label = strategy + "".join(f" {k}={v}" for k, v in options.items())
        for case, value in zip(CASES, results[0], strict=True):
            print(f"{label:45s} {case[0]:4s} {case[1]:5s} {value}", flush=True)


if __name__ == "__main__":
    main()
