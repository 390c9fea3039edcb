"""CUDA jobs' process groups: NCCL for CUDA tensors paired with gloo for the CPU tensors the
engines also exchange (an NCCL-only group refused them on the first GPU run, an H200)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from paratrain.parallel import strategy
from paratrain.runtime import devices


def test_a_cuda_job_pairs_nccl_with_gloo_and_a_cpu_job_keeps_gloo():
    assert devices.process_group_backend("nccl") == "cpu:gloo,cuda:nccl"
    assert devices.process_group_backend("gloo") == "gloo"


@pytest.mark.parametrize(("backend", "cuda"), [("cpu:gloo,cuda:nccl", True), ("gloo", False)])
def test_on_cuda_reads_the_groups_backend(monkeypatch, backend, cuda):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    assert devices.on_cuda() is cuda


def test_a_users_nccl_only_group_is_refused_with_the_group_that_works(monkeypatch):
    """A script that made its own group with NCCL alone would fail inside the first CPU
    broadcast; the engine says which group to make instead, before any collective."""
    monkeypatch.setattr(strategy.comm, "distributed", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(RuntimeError, match=r"init_process_group\('cpu:gloo,cuda:nccl'\)"):
        strategy.require_process_group("dp")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    strategy.require_process_group("dp")
