"""A checkpoint load that reaches a server before worker 0's initial SET is not lost.

Any worker may be the first to load (``engine.claim``), while worker 0 may still be sending
its initial parameters: the server holds the load until that SET has arrived, so the SET
cannot overwrite the loaded values. Checked on an in-process server, with the load in a
thread, as the server runs it (one thread per worker).
"""

from __future__ import annotations

import threading
import time

import torch

import paratrain
from paratrain.parallel.ps.optimizer_spec import describe_optimizer
from paratrain.parallel.ps.protocol import Op, encode_json, request_header
from paratrain.parallel.ps.server import ShardServer
from paratrain.parallel.ps.sharding import ParamSpec


def test_a_load_waits_for_the_initial_set_and_wins(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(7.0)
    saved = paratrain.setup(
        model,
        optimizer=lambda p: torch.optim.SGD(p, lr=1.0),
        loss_fn=torch.nn.functional.mse_loss,
        strategy="single",
    ).save_checkpoint(tmp_path / "ckpt")
    spec = {
        "workers": 2,
        "servers": 1,
        "staleness": 0,
        "staleness_lr": "inverse",
        "shards": [[ParamSpec("weight", (1, 3), torch.float32).to_json()]],
        "optimizer": describe_optimizer(lambda p: torch.optim.SGD(p, lr=1.0), model),
    }
    server = ShardServer(spec, 0, store=None, prefix="test")
    request = encode_json({"path": str(saved)})
    header = request_header(Op.LOAD, flags=1, json_bytes=request.numel())
    replies = []
    load = threading.Thread(
        target=lambda: replies.append(server._process(1, Op.LOAD, header, [request]))
    )
    load.start()
    time.sleep(0.3)
    assert load.is_alive() and not replies, "the load must wait for worker 0's SET"
    server._process(0, Op.SET, request_header(Op.SET, flags=1), [torch.zeros(3)])
    load.join(timeout=10)
    assert replies and server.params["weight"].detach().reshape(-1).tolist() == [7.0] * 3
