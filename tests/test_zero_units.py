"""zero3's units: a model's repeated blocks by default (as FSDP's auto-wrap policies pick
them), the layers of an nn.Sequential as before, or the modules ``units=`` names."""

from __future__ import annotations

import pytest
import torch

import paratrain
from tests import unit_workers, workers
from tests.test_parity_dp import TOLERANCE, relative_error

GPT2_UNITS = [("transformer.h.0", 12704), ("transformer.h.1", 12704), ("<root>", 2496)]
"""Each GPT2Block a unit; the tied embedding/head, the position embedding and ln_f in the root."""
LLAMA_UNITS = [("model.layers.0", 9280), ("model.layers.1", 9280), ("<root>", 4128)]
SHARED_UNITS = [("blocks.0+blocks.2", 352), ("blocks.1", 304), ("<root>", 309)]
"""The blocks sharing ``fc.weight`` are one unit; ``gate`` (used between blocks) is root."""
GPT2_HEAD_UNIT = [
    ("transformer.wte+lm_head", 2048),
    ("transformer.h.0", 12704),
    ("transformer.h.1", 12704),
    ("<root>", 448),
]
"""``units=["transformer.h.*", "lm_head"]``: the head's tie pulls the embedding into its unit."""


def layout(model, units=None):
    from paratrain.parallel.zero.units import unit_layout

    return unit_layout(model, units)


def test_default_units_are_the_repeated_blocks():
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    gpt2 = unit_workers.build("gpt2")
    assert layout(gpt2) == GPT2_UNITS
    assert layout(unit_workers.build("llama")) == LLAMA_UNITS
    assert layout(unit_workers.build("shared_blocks")) == SHARED_UNITS
    wrapped = torch.nn.ModuleDict({"net": workers.parity_model("gpt")})
    assert [label for label, _ in layout(wrapped)] == ["net.1", "net.2", "<root>"]
    for units in (["transformer.h.*"], "transformer.h.?", "GPT2Block", GPT2Block):
        assert layout(gpt2, units) == GPT2_UNITS, units
    assert layout(gpt2, ["transformer.h.*", "lm_head"]) == GPT2_HEAD_UNIT
    assert layout(gpt2, "*") == [("transformer+lm_head", 27904)]  # the top-level children


def test_a_container_that_is_never_called_is_not_a_unit():
    """A ModuleList child fires no hooks, so its layers are the units (it was one unit)."""
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Linear(2, 3), torch.nn.LayerNorm(3)])
    model.scales = torch.nn.ParameterList([torch.nn.Parameter(torch.ones(3))])
    assert layout(model) == [("layers.0", 9), ("layers.1", 6), ("<root>", 3)]
    assert layout(model, "layers") == layout(model)
    with pytest.raises(ValueError, match="never called"):
        layout(model, "scales")


def test_a_layer_list_keeps_one_unit_per_layer():
    """The reference models (nn.Sequential) keep the layout the parity figures were made with."""
    for kind in ("gpt", "mlp", "unused"):
        model = workers.parity_model(kind)
        children = [
            (name, sum(p.numel() for p in child.parameters()))
            for name, child in model.named_children()
            if any(p.requires_grad for p in child.parameters())
        ]
        root = [("<root>", 3)] if kind == "unused" else []
        assert layout(model) == children + root, kind
    assert [label for label, _ in layout(workers.parity_model("gpt"))] == ["0", "1", "2", "3", "4"]


@pytest.mark.parametrize(
    ("units", "message"),
    [
        (["transformer.blocks.*"], "'transformer.blocks.*' matches no module"),
        (["transformer.h", "transformer.h.0"], "overlap"),
        (["GPT2Block", "transformer.h.1"], "overlap"),
        (["transformer.drop"], "no trainable parameters"),
        ([], "names no module"),
        ([3], "module names"),
    ],
)
def test_units_option_refusals(units, message):
    with pytest.raises(ValueError, match=message):
        layout(unit_workers.build("gpt2"), units)


def test_units_refused_before_any_worker_starts():
    from paratrain.config import TrainConfig
    from paratrain.parallel import RunSpec, strategy_class

    options = TrainConfig(strategy="zero3", units="transformer.h.*, lm_head").strategy_options()
    assert options["units"] == ["transformer.h.*", "lm_head"]
    zero3 = strategy_class("zero3")
    run = RunSpec(
        devices=2,
        global_batch=8,
        options={"units": ["blocks.*"]},
        build_model=lambda: workers.parity_model("gpt"),
    )
    with pytest.raises(ValueError, match="'blocks.*' matches no module"):
        zero3.check_run(run)
    with pytest.raises(ValueError, match="recompute"):
        paratrain.setup(
            workers.parity_model("gpt"),
            optimizer=workers.parity_optimizer("sgd"),
            loss_fn=torch.nn.functional.cross_entropy,
            strategy="zero3",
            recompute=True,
            units=["1", "2"],
        )


@pytest.mark.slow
def test_zero3_block_units_match_single_device_and_save_a_loadable_checkpoint(tmp_path):
    """Two workers, SGD-momentum: Hugging Face GPT-2 (tied) and Llama (untied), a model whose
    blocks share a weight and whose own parameter is used between blocks, and GPT-2 with
    the tied head named as a unit."""
    runs = [
        ("zero3", "gpt2", str(tmp_path / "gpt2"), {}),
        ("zero3", "llama", str(tmp_path / "llama"), {}),
        ("zero3", "shared_blocks", None, {}),
        ("zero3", "gpt2", None, {"units": ["transformer.h.*", "lm_head"]}),
    ]
    expected_units = [GPT2_UNITS, LLAMA_UNITS, SHARED_UNITS, GPT2_HEAD_UNIT]
    results = paratrain.launch(unit_workers.train_all, devices=2, args=(runs,))
    references = {kind: unit_workers.train("single", kind) for kind in ("gpt2", "llama")}
    references["shared_blocks"] = unit_workers.train("single", "shared_blocks")
    for rank_results in results:
        for (_, kind, _, options), units, result in zip(
            runs, expected_units, rank_results, strict=True
        ):
            reference = references[kind]
            assert result["units"] == units, (kind, options)
            # one unit at a time (plus the root) is whole when a unit's forward starts
            assert result["gathered"] == {
                label: {(label, "<root>")} for label, _ in units if label != "<root>"
            }
            error = relative_error(result["state"], reference["state"])
            assert error <= TOLERANCE, f"{kind} {options}: relative error {error:.2e}"
            assert result["losses"] == pytest.approx(reference["losses"], rel=TOLERANCE)
            assert relative_error(reference["state"], unit_workers.build(kind).state_dict()) > 1e-3
    for kind in ("gpt2", "llama"):
        fresh = unit_workers.build(kind)
        torch.nn.init.zeros_(fresh.lm_head.weight)
        fresh.load_state_dict(paratrain.load_model_state(tmp_path / kind), strict=True)
        assert relative_error(fresh.state_dict(), references[kind]["state"]) <= TOLERANCE
    tied = unit_workers.build("gpt2")
    tied.load_state_dict(paratrain.load_model_state(tmp_path / "gpt2"), strict=True)
    assert tied.lm_head.weight is tied.transformer.wte.weight
