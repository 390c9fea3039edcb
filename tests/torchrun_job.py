"""A job for ``torchrun``: paratrain.launch must run the worker in this process.

Used by tests/test_torchrun.py; prints one JSON line per rank.
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

import paratrain
from paratrain.models import build_model


def worker() -> dict:
    torch.manual_seed(0)
    engine = paratrain.setup(
        build_model("mlp", in_features=6, hidden=8, depth=1, classes=3),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        loss_fn=F.cross_entropy,
        strategy="dp",
    )
    generator = torch.Generator().manual_seed(5)
    for _ in range(3):
        stats = engine.train_step(
            torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,), generator=generator)
        )
    state = engine.state_dict()
    return {
        "rank": engine.rank,
        "world": engine.world_size,
        "loss": stats.loss,
        "checksum": float(sum(v.double().sum() for v in state.values())),
    }


if __name__ == "__main__":
    print(json.dumps(paratrain.launch(worker)), flush=True)  # a list on every rank
    # The group launch created is gone before exit (gloo's threads torn down with the
    # interpreter can abort a finished process).
    assert not torch.distributed.is_initialized(), "launch left its process group behind"
