"""Pipeline behaviour beyond parity: memory by schedule, shapes, refusals, the CLI and report."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch
from torch import nn

import paratrain
from paratrain.cli import main
from paratrain.models import build_model
from paratrain.parallel.layers import LayerListError, LayerSlice, layer_list
from paratrain.parallel.pipeline.structure import (
    StructureError,
    decode_header,
    encode_header,
    flatten,
    unflatten,
)
from tests import workers
from tests.test_cli_train import SHARED_DATA
from tests.test_parity_dp import TOLERANCE, relative_error


def test_layer_slice_maps_names_both_ways():
    part = LayerSlice(3, 5, "layers.")
    assert part.canonical("0.weight") == "layers.3.weight"
    assert part.canonical("1.attn.qkv.weight") == "layers.4.attn.qkv.weight"
    assert part.local("layers.4.bias") == "1.bias"
    assert part.local("layers.5.bias") is None and part.local("head.weight") is None


def test_layer_list_accepts_sequential_or_layers_attribute_and_refuses_others():
    seq = nn.Sequential(nn.Linear(2, 2))
    assert layer_list(seq) == (seq, "")

    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(2, 2))

    wrapped = Wrapped()
    assert layer_list(wrapped) == (wrapped.layers, "layers.")
    with pytest.raises(LayerListError, match="rewrite the model as nn.Sequential"):
        layer_list(nn.Linear(2, 2))


def test_activation_header_round_trip():
    tensor = torch.zeros(3, 5, 7, dtype=torch.bfloat16)
    tree, leaves = decode_header(encode_header(tensor, torch.device("cpu")))
    assert leaves == [(torch.bfloat16, [3, 5, 7])]
    assert unflatten(tree, [tensor]) is tensor


def test_a_structured_activation_round_trips_with_its_plain_values():
    hidden, mask = torch.randn(2, 4, 8), torch.ones(2, 4, dtype=torch.bool)
    value = {"hidden": hidden, "extras": (mask, None, 3, [torch.zeros(1), "x"])}
    tree, leaves = decode_header(encode_header(value, torch.device("cpu")))
    assert leaves == [(torch.float32, [2, 4, 8]), (torch.bool, [2, 4]), (torch.float32, [1])]
    rebuilt = unflatten(tree, flatten(value)[0])
    assert rebuilt["hidden"] is hidden and rebuilt["extras"][0] is mask
    assert rebuilt["extras"][1:3] == (None, 3) and rebuilt["extras"][3][1] == "x"
    assert isinstance(rebuilt["extras"], tuple) and isinstance(rebuilt["extras"][3], list)


def test_a_value_that_cannot_cross_a_stage_boundary_is_refused():
    with pytest.raises(StructureError, match="not set"):
        flatten({"a": {1, 2}})
    with pytest.raises(StructureError, match="string keys"):
        flatten({1: torch.zeros(1)})
    with pytest.raises(StructureError, match="more than 64"):
        flatten([torch.zeros(1)] * 65)


def test_flattening_a_value_leaves_no_reference_cycle_behind():
    """A nested function that calls itself is a cycle (function -> closure cell ->
    function); closing over the leaves, it kept every activation a stage sent or received
    alive until the cyclic collector ran. With the collector off, dropping the leaves
    frees the tensor at once."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        tensor = torch.zeros(4)
        alive = weakref.ref(tensor)
        leaves, _ = flatten({"a": (tensor, [tensor, 1]), "b": None})
        assert len(leaves) == 2
        del leaves, tensor
        assert alive() is None
    finally:
        if was_enabled:
            gc.enable()


def test_a_pipeline_step_leaves_no_tensor_in_a_reference_cycle():
    """Under 1F1B, interleaved 1F1B and ZB-H1, two steps on 2 workers leave nothing for
    the cyclic collector to free: a round's activations go when their last use does (the
    planner's live-memory predictions assume so)."""
    settings = [
        {"stages": 2, "micro_batches": 4},
        {"stages": 2, "micro_batches": 4, "virtual_stages": 2},
        {"stages": 2, "micro_batches": 4, "schedule": "zb-h1"},
    ]
    results = paratrain.launch(workers.tensors_left_in_cycles_worker, devices=2, args=(settings,))
    assert results == [[0, 0, 0], [0, 0, 0]]


@pytest.mark.slow
def test_1f1b_holds_fewer_activations_than_gpipe_and_recompute_fewer_still():
    settings = [
        {"stages": 2, "micro_batches": 8, "schedule": "gpipe"},
        {"stages": 2, "micro_batches": 8, "schedule": "1f1b"},
        {"stages": 2, "micro_batches": 8, "schedule": "1f1b", "recompute": True},
    ]
    results = paratrain.launch(workers.activation_peaks_worker, devices=2, args=(settings,))
    gpipe, one_f_one_b, recompute = results[0]  # stage 0: 8 vs 2 micro-batches in flight
    assert one_f_one_b < 0.4 * gpipe, (gpipe, one_f_one_b)
    assert recompute < 0.6 * one_f_one_b, (one_f_one_b, recompute)
    last_gpipe, last_1f1b, _ = results[1]  # the last stage holds one micro-batch under 1F1B
    assert last_1f1b < 0.3 * last_gpipe


@pytest.mark.slow
@pytest.mark.parametrize(
    ("lengths", "posted_ahead"),
    [
        ((8, 4, 6), (0, 0)),  # never two equal headers in a row: nothing posted ahead
        # of steps 3 to 7, those after two steps of equal length post their first
        # activation ahead (8 8 | 8, 8 8 | 4, 4 4 | 6): 3 rounds, the second and third miss
        ((8, 8, 8, 4, 4, 6, 6), (3, 2)),
    ],
)
def test_shapes_may_change_between_steps(monkeypatch, lengths, posted_ahead):
    """Parity with one device (the tolerance of the parity tests) while the sequence
    length changes, whether or not the round's first activation was posted before its
    header in the last one's shapes (``p2p``); the receiving stage's link says which."""
    results = paratrain.launch(workers.varying_length_worker, devices=2, args=(lengths,))
    monkeypatch.setenv("PARATRAIN_TEST_STRATEGY", "single")
    reference_state, reference_losses, _ = workers.varying_length_worker(lengths)
    state, losses, _ = results[0]
    assert relative_error(state, reference_state) <= TOLERANCE
    assert losses == pytest.approx(reference_losses, rel=TOLERANCE)
    assert results[1][2] == [posted_ahead]


def test_a_link_posts_the_first_activation_ahead_only_after_two_equal_headers():
    """A bare link, 2 micro-batches a round: each round's values arrive exactly as sent
    (a tensor, a smaller one, then a dict with a plain value), whether micro-batch 0 was
    posted before the header and the header agreed (rounds 3 and 8), or then differed in
    shape (round 4) or in structure (round 6) and the sender filled the early receives with
    zeros and moved micro-batch 0 to other tags."""
    generator = torch.Generator().manual_seed(0)

    def value(kind: str) -> object:
        if kind == "a":
            return torch.randn(3, 4, generator=generator)
        if kind == "b":
            return torch.randn(2, 4, generator=generator)
        return {"h": torch.randn(2, 4, generator=generator), "ids": torch.arange(2), "n": 3}

    kinds = ["a", "a", "a", "b", "b", "c", "c", "c"]
    rounds = [[value(kind), value(kind)] for kind in kinds]
    results = paratrain.launch(workers.stage_link_rounds_worker, devices=2, args=(rounds,))
    received = results[1]["received"]
    sent = [one for values in rounds for one in values]
    assert len(received) == len(sent)
    for got, want in zip(received, sent, strict=True):
        if isinstance(want, dict):
            assert got.keys() == want.keys() and got["n"] == 3
            assert torch.equal(got["h"], want["h"]) and torch.equal(got["ids"], want["ids"])
        else:
            assert torch.equal(got, want)
    # ahead in rounds 3 (a a | a), 4 (a a | b: missed), 6 (b b | c: missed), 8 (c c | c)
    assert (results[1]["ahead"], results[1]["missed"]) == (4, 2)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--depth", "1", "--stages", "5", "--devices", "5", "--global-batch", "40"],
            "the model has 4 layers, so it cannot be split into 5 stages",
        ),
        (
            ["--depth", "1", "--stages", "2", "--devices", "2", "--balance", "1,2"],
            "make the entries add up to 4",
        ),
        (
            ["--stages", "3", "--devices", "4"],
            "3 pipeline stages do not divide 4 workers evenly",
        ),
    ],
)
def test_impossible_pipelines_are_refused_before_workers_start(tmp_path, capsys, flags, message):
    common = ["train", "--no-progress", "--model", "mlp", "--dataset", "synthetic"]
    code = main([*common, "--strategy", "pipeline", *flags, "--run-dir", str(tmp_path)])
    assert code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(not SHARED_DATA.exists(), reason="../shared/data (tinyshakespeare) is absent")
def test_cli_pipeline_run_then_report_draws_the_timeline(tmp_path, capsys):
    run_dir = tmp_path / "pipe"
    code = main(
        [
            "train",
            "--no-progress",
            "--model",
            "gpt",
            "--dataset",
            "shakespeare",
            "--data-dir",
            str(SHARED_DATA),
            "--strategy",
            "pipeline",
            "--stages",
            "2",
            "--micro-batches",
            "4",
            "--schedule",
            "1f1b",
            "--devices",
            "2",
            "--steps",
            "4",
            "--global-batch",
            "8",
            "--n-layer",
            "2",
            "--n-embd",
            "32",
            "--block-size",
            "16",
            "--eval-every",
            "2",
            "--sample-chars",
            "10",
            "--run-dir",
            str(run_dir),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "strategy pipeline" in out and "parameters held   worker 0:" in out
    full = build_model("gpt", vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=32)
    assert set(paratrain_checkpoint(run_dir)) == set(full.state_dict())
    assert main(["report", str(run_dir)]) == 0
    report = capsys.readouterr().out
    assert "theoretical bubble  20.0%" in report and "measured bubble" in report
    assert (run_dir / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trace = json.loads((run_dir / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert len(spans) == 4 * 2 * 4 * 2  # steps x stages x micro-batches x (F, B)


def paratrain_checkpoint(run_dir):
    from paratrain.checkpoints.format import load_model_state

    return load_model_state(run_dir / "final")
