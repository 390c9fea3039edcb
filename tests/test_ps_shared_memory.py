"""The ps shared-memory transport: regions, their refusals, and a server that uses them."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from paratrain.parallel.ps import shared_memory
from paratrain.parallel.ps.protocol import (
    Op,
    ShardLayout,
    encode_json,
    request_header,
)
from paratrain.parallel.ps.sharding import ParamSpec
from paratrain.parallel.ps.shared_memory import (
    NAME_PREFIX,
    SHARED_DIR,
    SharedRegion,
    region_bytes,
    resolve_transport,
)
from paratrain.parallel.ps.worker_buffers import CopiedBuffers, MappedBuffers
from tests.test_ps_precision import shard_server, weight

pytestmark = pytest.mark.skipif(
    not shared_memory.shared_memory_available(), reason=f"this host has no writable {SHARED_DIR}"
)

MIXED = ShardLayout(
    [
        ParamSpec("a", (3, 5), torch.float32),
        ParamSpec("b", (7,), torch.float64),
        ParamSpec("c", (2,), torch.float32),
    ]
)


def leftovers() -> list[str]:
    return sorted(p.name for p in SHARED_DIR.iterdir() if p.name.startswith(NAME_PREFIX))


def test_a_region_holds_one_aligned_flat_tensor_per_dtype():
    # float32: 17 values (68 bytes) -> the float64 tensor starts at 128; 7 x 8 = 56 more.
    assert region_bytes(MIXED) == 192
    region = SharedRegion.create(MIXED, "layout")
    region.unlink()
    assert [(t.dtype, t.numel()) for t in region.flats] == [
        (torch.float32, 17),
        (torch.float64, 7),
    ]
    assert all(t.data_ptr() % 64 == 0 for t in region.flats)


def test_both_sides_see_the_same_memory_after_the_file_is_gone():
    before = leftovers()
    created = SharedRegion.create(MIXED, "share")
    attached = SharedRegion.attach(str(created.path), MIXED)
    created.unlink()
    assert leftovers() == before, "the file must be deleted once the peer mapped it"
    created.flats[0].copy_(torch.arange(17.0))
    attached.flats[1].fill_(2.5)
    assert attached.flats[0].tolist() == list(map(float, range(17)))
    assert created.flats[1].tolist() == [2.5] * 7


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/tmp/paratrain-ps-x", "is not a paratrain ps buffer in /dev/shm"),
        (str(SHARED_DIR / "someone-elses-file"), "is not a paratrain ps buffer"),
    ],
)
def test_a_server_maps_only_paratrain_buffers(path, message):
    with pytest.raises(ValueError, match=message):
        SharedRegion.attach(path, MIXED)


def test_a_server_refuses_a_buffer_of_another_size():
    other = ShardLayout([ParamSpec("a", (100,), torch.float32)])
    region = SharedRegion.create(other, "size")
    try:
        with pytest.raises(ValueError, match="holds 448 bytes, not the 192 of this server's shard"):
            SharedRegion.attach(str(region.path), MIXED)
    finally:
        region.unlink()


def test_no_room_in_shared_memory_says_what_to_change_and_leaves_no_file(monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    before = leftovers()
    said = "enlarge it \\(Docker: --shm-size\\) or pass transport='gloo'"
    with pytest.raises(OSError, match=said):
        SharedRegion.create(MIXED, "full")
    assert leftovers() == before


def test_transport_choices(monkeypatch, tmp_path):
    assert resolve_transport("auto") == "shared_memory"
    assert resolve_transport("gloo") == "gloo"
    said = "transport must be one of 'auto', 'shared_memory', 'gloo'"
    with pytest.raises(ValueError, match=said):
        resolve_transport("tcp")
    monkeypatch.setattr(shared_memory, "SHARED_DIR", tmp_path / "absent")
    assert resolve_transport("auto") == "gloo", "auto falls back, and the engine reports it"
    with pytest.raises(ValueError, match="pass transport='gloo'"):
        resolve_transport("shared_memory")


def test_a_server_reads_pushes_from_and_writes_pulls_into_a_workers_regions():
    server = shard_server(staleness=None, staleness_lr="constant")
    layout = server.layout
    push_region = SharedRegion.create(layout, "push")
    pull_region = SharedRegion.create(layout, "pull")
    request = encode_json({"push": str(push_region.path), "pull": str(pull_region.path)})
    header = request_header(Op.ATTACH, flags=1, json_bytes=request.numel())
    server._process(0, Op.ATTACH, header, [request])
    push_region.unlink()
    pull_region.unlink()

    push_region.flats[0].copy_(torch.tensor([1.0, 2.0, 3.0]))
    # This server has no gloo group: had it posted a receive, this would fail.
    payload = server._receive_payload(0, Op.PUSH, request_header(Op.PUSH, flags=1))
    assert payload[0].tolist() == [1.0, 2.0, 3.0]
    push_header = request_header(Op.PUSH, flags=1, samples=8, has_grad=[True])
    server._process(0, Op.PUSH, push_header, payload)
    assert weight(server) == [-1.0, -2.0, -3.0]

    reply = server._process(0, Op.PULL, request_header(Op.PULL, flags=1), [])
    assert len(reply) == 1, "a pull's reply is its header alone"
    assert reply[0][1] == 1.0  # the version
    assert pull_region.flats[0].tolist() == [-1.0, -2.0, -3.0]
    other = server._process(1, Op.PULL, request_header(Op.PULL, flags=1), [])
    assert len(other) == 2, "a worker on gloo still gets the parameters after its header"
    server._retire(0, lost=None)
    assert 0 not in server._shared


def test_an_attach_of_a_file_that_is_not_a_ps_buffer_is_refused():
    server = shard_server(staleness=None)
    request = encode_json({"push": "/etc/passwd", "pull": "/etc/passwd"})
    header = request_header(Op.ATTACH, flags=1, json_bytes=request.numel())
    with pytest.raises(ValueError, match="is not a paratrain ps buffer"):
        server._process(0, Op.ATTACH, header, [request])


class UnusedBranch(torch.nn.Module):
    """A used layer, a layer forward never calls, and a frozen weight."""

    def __init__(self) -> None:
        super().__init__()
        self.used = torch.nn.Linear(3, 2)
        self.unused = torch.nn.Linear(3, 2)
        self.frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x) * self.frozen


def two_server_buffers(kind: str):
    """A model split over two servers' layouts, with the worker buffers of ``kind``."""
    torch.manual_seed(0)
    model = UnusedBranch()
    named = dict(model.named_parameters())
    shards = [
        [(n, named[n]) for n in ("used.weight", "used.bias")],
        [(n, named[n]) for n in ("unused.weight", "unused.bias", "frozen")],
    ]
    layouts = [ShardLayout([ParamSpec(n, tuple(p.shape), p.dtype) for n, p in s]) for s in shards]
    params = [[p for _, p in shard] for shard in shards]
    if kind == "gloo":
        return model, layouts, CopiedBuffers(layouts, params), None
    regions = [
        (SharedRegion.create(layout, "pull"), SharedRegion.create(layout, "push"))
        for layout in layouts
    ]
    for pull, push in regions:
        pull.unlink()
        push.unlink()
    pulls, pushes = [r[0].flats for r in regions], [r[1].flats for r in regions]
    return model, layouts, MappedBuffers(layouts, params, pulls, pushes), (pulls, pushes)


@pytest.mark.parametrize("kind", ["gloo", "shared_memory"])
def test_a_parameter_without_a_gradient_is_pushed_as_none_not_zeros(kind):
    model, _, buffers, _ = two_server_buffers(kind)
    for _ in range(2):  # the second step must not see the first step's gradients
        buffers.clear_grads()
        model(torch.ones(4, 3)).sum().backward()
        assert buffers.has_grad() == [[True, True], [False, False, False]]
    assert model.used.bias.grad.tolist() == [4.0, 4.0]


def test_mapped_parameters_live_in_the_pull_regions_and_gradients_in_the_push_regions():
    model, layouts, buffers, (pulls, pushes) = two_server_buffers("shared_memory")
    initial = model.used.weight.detach().clone()
    assert torch.equal(layouts[0].views(pulls[0])[0], initial), "values kept when moved"
    pulls[0][0][:6] = 7.0  # what a server's pull reply writes
    assert model.used.weight.tolist() == [[7.0] * 3] * 2, "a pull needs no copy"
    buffers.clear_grads()
    model(torch.ones(4, 3)).sum().backward()
    assert layouts[0].views(pushes[0])[1].tolist() == [4.0, 4.0], "backward wrote the region"
    assert buffers.push_payloads() is None and buffers.pull_payloads() is None
