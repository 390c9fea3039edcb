"""The ps engine's pure parts (sharding, packing, staleness bookkeeping, the optimizer's
description) and its refusals; no processes."""

from __future__ import annotations

import pytest
import torch

import paratrain
from paratrain.parallel.ps.engine import check_straggler
from paratrain.parallel.ps.optimizer_spec import build_optimizer, describe_optimizer
from paratrain.parallel.ps.protocol import ShardLayout
from paratrain.parallel.ps.sharding import ParamSpec, assign_shards
from paratrain.parallel.ps.staleness import StalenessBook, check_bound
from tests import workers


def specs(*sizes: int) -> list[ParamSpec]:
    return [ParamSpec(f"p{i}", (n,), torch.float32) for i, n in enumerate(sizes)]


def test_shards_are_balanced_by_bytes_and_keep_model_order():
    shards = assign_shards(specs(100, 10, 60, 50, 5), 2)
    assert [[p.name for p in shard] for shard in shards] == [["p0", "p1", "p4"], ["p2", "p3"]]
    loads = [sum(p.nbytes for p in shard) for shard in shards]
    assert loads == [115 * 4, 110 * 4]
    assert assign_shards(specs(100, 10, 60, 50, 5), 2) == shards  # deterministic


def test_more_servers_than_parameters_is_refused():
    with pytest.raises(ValueError, match="use at most 2 server"):
        assign_shards(specs(3, 4), 3)
    with pytest.raises(ValueError, match="servers must be a positive integer"):
        assign_shards(specs(3, 4), 0)


def test_layout_packs_mixed_dtypes_and_missing_gradients():
    layout = ShardLayout(
        [
            ParamSpec("a", (2, 3), torch.float32),
            ParamSpec("b", (4,), torch.float64),
            ParamSpec("c", (5,), torch.float32),
        ]
    )
    a, b = torch.randn(2, 3), torch.randn(4, dtype=torch.float64)
    flats = layout.pack([a, b, None])
    assert [f.dtype for f in flats] == [torch.float32, torch.float64]
    views = layout.views(flats)
    assert torch.equal(views[0], a) and torch.equal(views[1], b)
    assert torch.equal(views[2], torch.zeros(5))
    reused = [torch.full_like(f, float("nan")) for f in flats]  # last step's leftovers
    again = layout.pack([None, b, a.reshape(-1)[:5]], out=reused)
    assert all(x is y for x, y in zip(again, reused, strict=True)), "packed into ``out``"
    views = layout.views(again)
    assert torch.equal(views[0], torch.zeros(2, 3)) and torch.equal(views[1], b)
    assert torch.equal(views[2], a.reshape(-1)[:5])


def test_a_pull_sees_parameters_set_at_the_same_version():
    from paratrain.parallel.ps.protocol import Op, request_header
    from tests.test_ps_precision import shard_server

    server = shard_server(staleness=None)
    assert server._pull(0)[1].tolist() == [0.0] * 3  # packed once for version 0
    server._process(0, Op.SET, request_header(Op.SET, flags=1), [torch.ones(3)])
    assert server.version == 0 and server._pull(1)[1].tolist() == [1.0] * 3


def test_bound_holds_back_only_the_worker_ahead_and_a_lost_worker_stops_counting():
    book = StalenessBook(3, bound=1)
    for worker in (0, 0, 1):
        book.record_push(worker, staleness=0)
    assert not book.may_pull(0) and book.may_pull(1) and book.may_pull(2)
    book.retire(2, lost="killed")
    assert book.may_pull(0)
    book.retire(1)  # finished
    book.retire(1, lost="died later")  # a finished worker that dies was not lost
    assert book.lost == {2: "killed"}
    assert book.summary()["staleness_histogram"] == {"0": 3}


def test_asynchronous_never_waits_and_bad_bounds_are_refused():
    book = StalenessBook(2, bound=None)
    for _ in range(5):
        book.record_push(0, staleness=2)
    assert book.may_pull(0)
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="staleness must be"):
            check_bound(bad)


def test_a_synchronous_round_answers_its_pushes_with_the_global_batch_loss():
    """Each push carries its share's loss; the round's mean, weighted by samples (skipped
    pushes too), comes back once the round closed. With backup workers the reply does
    not wait (no version is one global batch's); the worker keeps its share's loss."""
    from paratrain.parallel.ps.protocol import LOSS_FIELD, ROUND_LOSS_FIELD, Op, request_header
    from tests.test_ps_precision import shard_server

    def push(server, worker: int, loss: float, samples: int, grad: bool = True) -> None:
        header = request_header(
            Op.PUSH,
            flags=1,
            pulled=server.version,
            samples=samples,
            loss=loss,
            skipped=not grad,
            has_grad=[grad],
        )
        assert header[LOSS_FIELD] == loss
        server._process(worker, Op.PUSH, header, [torch.ones(3)] if grad else [])

    server = shard_server(staleness=0, workers=3)
    push(server, 0, 1.0, samples=8)
    push(server, 1, 4.0, samples=8, grad=False)  # an fp16 overflow: its loss still counts
    assert server.version == 0 and sorted(server._awaiting) == [0, 1]
    push(server, 2, 2.5, samples=16)
    replies = [server._round_reply(w)[0] for w in range(3)]  # the round closed: no wait
    assert [r[ROUND_LOSS_FIELD].item() for r in replies] == [2.5] * 3  # (8+32+40) / 32
    assert [r[1].item() for r in replies] == [1.0] * 3 and not server._awaiting
    backup = shard_server(staleness=0, workers=3, backup_workers=1)
    push(backup, 0, 1.0, samples=8)
    assert not backup._awaiting and not backup.reports_round_loss


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01, betas=(0.8, 0.95)),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    "adam-foreach": lambda p: torch.optim.Adam(p, lr=0.01, foreach=True),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_rebuilt_optimizer_takes_the_same_step(name):
    factory = OPTIMIZERS[name]
    model = workers.parity_model("mlp")
    description = describe_optimizer(factory, model)
    copy = {n: torch.nn.Parameter(p.detach().clone()) for n, p in model.named_parameters()}
    rebuilt = build_optimizer(description, copy)
    original = factory(model.parameters())
    assert type(rebuilt) is type(original)
    # Fused where torch has a CPU kernel and the user named no implementation (see
    # optimizer_spec); the user's choice (foreach=True) and classes without one are kept.
    fused = name in ("sgd", "adam", "adamw")
    assert rebuilt.defaults.get("fused") is (True if fused else original.defaults.get("fused"))
    for group, mine in zip(original.param_groups, rebuilt.param_groups, strict=True):
        assert {k: v for k, v in group.items() if k not in ("params", "fused")} == {
            k: v for k, v in mine.items() if k not in ("params", "fused")
        }
    for _ in range(3):
        for (_, p), q in zip(model.named_parameters(), copy.values(), strict=True):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        original.step()
        rebuilt.step()
    for n, p in model.named_parameters():
        # another kernel: the same update up to float rounding; the derivation is
        # test_fused_optim.py's (3 steps x one ulp, 2^-23: 3.6e-7 relative < rtol 1e-6;
        # atol 1e-7 for entries near zero)
        if fused:
            torch.testing.assert_close(copy[n], p, rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(p, copy[n]), n


def test_optimizers_that_cannot_travel_are_refused():
    model = workers.parity_model("mlp")
    with pytest.raises(ValueError, match="plain numbers"):
        describe_optimizer(lambda p: torch.optim.SGD(p, lr=torch.tensor(0.1)), model)

    class Local(torch.optim.SGD):
        pass

    with pytest.raises(ValueError, match="importable module"):
        describe_optimizer(lambda p: Local(p, lr=0.1), model)


def test_straggler_settings_are_checked():
    assert check_straggler({"rank": 1, "slowdown": 3}, 2) == {"rank": 1, "slowdown": 3.0}
    with pytest.raises(ValueError, match="worker rank in 0..1"):
        check_straggler({"rank": 2, "slowdown": 3}, 2)
    with pytest.raises(ValueError, match="slowdown must be a number >= 1"):
        check_straggler({"rank": 0, "slowdown": 0.5}, 2)
    with pytest.raises(ValueError, match="must be a dict"):
        check_straggler({"rank": 0}, 2)


def test_ps_outside_a_launch_says_what_to_do():
    with pytest.raises(RuntimeError, match="paratrain.launch"):
        workers.parity_engine("ps", "mlp", "sgd")


def test_ps_options_are_listed_when_a_wrong_one_is_given():
    with pytest.raises(ValueError, match="staleness"):
        paratrain.setup(
            workers.parity_model("mlp"),
            optimizer=workers.parity_optimizer("sgd"),
            loss_fn=torch.nn.functional.cross_entropy,
            strategy="ps",
            stalenes=2,
        )
