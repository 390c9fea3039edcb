"""The pipeline on models that are not layer lists: stages start at blocks named by module
(``split_points=["transformer.h.1"]``), or at blocks chosen among the model's repeated
ones; each stage runs the model's own forward (``parallel/pipeline/stage_run.py``), so
names stay the model's own and a checkpoint loads into the original class.

Tolerances: ``TOLERANCE`` (1e-5 relative, tests/test_parity_dp.py) where the engine and
the plain loop add the same micro-batch gradients in the same order (2 stages, one
replica: bit-equal in practice) or in another order (replicas' all-reduce, a tied weight's
two stages): float32 sums in another order differ by a few ulp (~1e-7 relative) per step,
well under 1e-5 after 4 steps. Adam is compared with a plain loop that accumulates the
same parts the engine has (its update m / (sqrt(v) + eps) magnifies the last-bit
difference of adding parts differently for near-zero gradients; tests/test_hf_models.py
and tests/test_loss_reduction.py write out why), SGD with the same loop too where the parts
are those of the engine's micro-batches.
"""

from __future__ import annotations

import pytest
import torch

import paratrain
import paratrain.losses  # noqa: F401  (test_hf_models.plain_loop reads it)
from paratrain.models import loss_for
from paratrain.parallel.piece_runs import PieceRuns
from paratrain.parallel.pipeline.partition import PartitionError
from paratrain.parallel.pipeline.split_points import every_block, plan_stages, valid_split_points
from tests import hf_workers, split_workers, user_layers, workers
from tests.test_parity_dp import TOLERANCE, relative_error


def test_split_points_name_blocks_and_own_the_rest_by_registration_order():
    plan = plan_stages(split_workers.build(), 2, ["blocks.1"])
    assert plan.container == "blocks" and plan.starts == [0, 1] and plan.balance == [1, 3]
    assert plan.owner["embed.weight"] == 0 and plan.owner["blocks.0.mix.weight"] == 0
    assert plan.owner["blocks.1.norm.bias"] == 1 and plan.owner["head.bias"] == 1
    assert set(plan.owner) == set(split_workers.build().state_dict())


def test_without_split_points_the_repeated_blocks_are_balanced_by_parameters():
    # 4 equal blocks of 544 parameters; the embedding (112) joins the first, the head (51)
    # the last: the exact balancer's best bottleneck cuts in the middle.
    assert plan_stages(split_workers.build(), 2, None).split_points == ["blocks.2"]
    assert plan_stages(split_workers.build(), 4, None).split_points == [
        "blocks.1",
        "blocks.2",
        "blocks.3",
    ]


def test_a_bad_split_point_is_refused_with_the_valid_names():
    model = split_workers.build()
    assert valid_split_points(model) == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    with pytest.raises(PartitionError, match=r"'blocks\.7' is not a block .* blocks\.0, blocks\.1"):
        plan_stages(model, 2, ["blocks.7"])
    with pytest.raises(PartitionError, match="not a block"):
        plan_stages(model, 2, ["head"])
    with pytest.raises(PartitionError, match="3 stages need 2 split points"):
        plan_stages(model, 3, ["blocks.1"])
    with pytest.raises(PartitionError, match="increasing order"):
        plan_stages(model, 3, ["blocks.2", "blocks.1"])


def test_a_piece_without_state_is_measured_and_cut():
    """A block container whose first block holds no state (the parity mlp's Flatten): the
    planner's cut before every block makes that piece (before, its setup moved the whole
    model to meta and failed with torch's "Cannot copy out of meta tensor"), and a cut at
    the next block leaves the first stage nothing of its own but still plans."""
    wrapped = user_layers.build("wrapped")
    assert plan_stages(wrapped, 2, ["body.1"]).owner["body.1.weight"] == 1
    assert every_block(wrapped, "body").starts == [0, 1, 2, 3, 4, 5]
    runs = PieceRuns(wrapped, "body", torch.device("cpu"))  # makes the Flatten's piece
    assert [type(block).__name__ for block in runs.blocks][:2] == ["Flatten", "Linear"]


@pytest.mark.slow
def test_the_planner_prices_every_pipeline_layout_of_a_model_with_a_stateless_first_block():
    """``paratrain.plan`` measures such a model cut before every block, the Flatten's
    piece included (before, that measurement failed on a meta tensor), and prices every
    pipeline layout."""
    plan_pipelines(user_layers.build("wrapped"))


def plan_pipelines(model: torch.nn.Module) -> paratrain.Plan:
    """``paratrain.plan`` of the pipeline's layouts of ``model`` (``user_layers``' wrapped
    mlp, compiled or not) on 2 workers, for the parity batches with Adam; asserts that
    none was refused."""
    x, y = workers.parity_batches("mlp")[0]
    plan = paratrain.plan(
        model,
        devices=2,
        global_batch=len(x),
        memory_per_device="1GiB",
        optimizer=workers.parity_optimizer("adam"),
        loss_fn=loss_for("mlp"),
        sample=(x, y),
        strategy="pipeline",
    )
    assert plan.strategy == "pipeline" and "cannot run" not in plan.table()
    return plan


@pytest.mark.slow
def test_a_model_cut_at_named_blocks_equals_the_plain_loop():
    """2 stages (SGD-momentum, Adam; named and chosen split points) and 2 replicas x 2
    stages, every one against the plain loop over the engine's parts (micro-batches x
    replicas)."""
    runs = [
        ("sgd", {"stages": 2, "micro_batches": 2, "split_points": ["blocks.1"]}),
        ("adam", {"stages": 2, "micro_batches": 2, "split_points": ["blocks.3"]}),
        ("adam", {"stages": 2, "micro_batches": 4, "schedule": "gpipe"}),
    ]
    results = paratrain.launch(split_workers.train_blocks, devices=2, args=(runs,))
    hybrid = [("adam", {"stages": 2, "micro_batches": 2, "split_points": ["blocks.2"]})]
    hybrid_results = paratrain.launch(split_workers.train_blocks, devices=4, args=(hybrid,))
    for (opt, options), (state, losses), label in [
        *[(run, result, "2 stages") for run, result in zip(runs, results[0], strict=True)],
        (hybrid[0], hybrid_results[0][0], "2 x 2"),
    ]:
        replicas = 2 if label == "2 x 2" else 1
        reference, reference_losses = split_workers.plain_loop(
            opt, options["micro_batches"] * replicas
        )
        assert relative_error(state, reference) <= TOLERANCE, (label, opt, options)
        assert losses == pytest.approx(reference_losses, rel=TOLERANCE), (label, opt, options)


@pytest.mark.slow
def test_a_value_read_past_the_split_point_is_refused():
    """The model adds the embedding's output to the blocks' result: the last stage would
    read a placeholder, and the first step says so instead."""
    with pytest.raises(Exception, match="holds NaN: the model uses something an earlier stage"):
        paratrain.launch(split_workers.train_skip, devices=2)


def test_hugging_face_split_points_are_found_and_refused_by_name():
    pytest.importorskip("transformers", reason="the dev extra installs transformers")
    gpt2, llama = hf_workers.build("gpt2"), hf_workers.build("llama")
    assert plan_stages(gpt2, 2, None).split_points == ["transformer.h.1"]
    assert plan_stages(llama, 2, None).split_points == ["model.layers.1"]
    plan = plan_stages(gpt2, 2, ["transformer.h.1"])
    assert plan.owner["transformer.wte.weight"] == 0 and plan.owner["lm_head.weight"] == 1
    with pytest.raises(PartitionError, match="transformer.h.0, transformer.h.1"):
        plan_stages(gpt2, 2, ["transformer.h.2"])


@pytest.mark.slow
def test_hugging_face_models_train_under_the_pipeline_and_load_into_a_fresh_model(tmp_path):
    """GPT-2 (head tied to the embedding, the two on different stages) and Llama, 2 stages,
    SGD-momentum and AdamW against Hugging Face's own loss accumulated over the same two
    micro-batches; each checkpoint loads strictly into a fresh model of the class."""
    pytest.importorskip("transformers", reason="the dev extra installs transformers")
    from tests.test_hf_models import plain_loop

    runs = [
        (kind, opt, {"stages": 2, "micro_batches": 2})
        for kind in ("gpt2", "llama")
        for opt in ("sgd", "adam")
    ]
    runs[1][2]["split_points"] = ["transformer.h.1"]
    results = paratrain.launch(split_workers.train_hf, devices=2, args=(runs, str(tmp_path)))
    for (kind, opt, _), (state, losses, path) in zip(runs, results[0], strict=True):
        reference, reference_losses = plain_loop(kind, opt, 2)
        assert relative_error(state, reference) <= TOLERANCE, (kind, opt)
        assert losses == pytest.approx(reference_losses, rel=TOLERANCE), (kind, opt)
        fresh = hf_workers.build(kind)
        fresh.load_state_dict(paratrain.load_model_state(path), strict=True)
        assert relative_error(dict(fresh.state_dict()), reference) <= TOLERANCE
        if kind == "gpt2":
            assert torch.equal(fresh.lm_head.weight, fresh.transformer.wte.weight)


def test_split_points_of_a_layer_list_are_its_balance_and_parse_from_the_command_line():
    from paratrain.parallel.pipeline.options import OPTIONS
    from paratrain.parallel.pipeline.split_points import layer_list_balance

    layers = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(5)])
    assert layer_list_balance(layers, ["2", "4"], 3) == [2, 2, 1]
    with pytest.raises(PartitionError, match="'0' is not a layer where a stage can start"):
        layer_list_balance(layers, ["0"], 2)
    option = next(o for o in OPTIONS if o.name == "split_points")
    assert option.flag == "--split-points"
    assert option.engine_value("transformer.h.2, transformer.h.4") == [
        "transformer.h.2",
        "transformer.h.4",
    ]


def test_a_shape_only_run_is_remembered_by_its_arguments_shapes():
    """Stage 1 meets stage 0's modules on meta each micro-batch; their outputs' shapes are
    remembered, so a second forward of the same shapes runs none of them, and another
    batch size runs them again. The output is the model's own either way."""
    from paratrain.parallel.pipeline.stage_run import NamedStage

    model = split_workers.build()
    plan = plan_stages(model, 2, ["blocks.2"])
    first = NamedStage(split_workers.build(), plan, [0], torch.device("cpu"))
    second = NamedStage(split_workers.build(), plan, [1], torch.device("cpu"))
    meta_calls: list[int] = []
    second.model.blocks[0].mix.register_forward_hook(lambda *_: meta_calls.append(1))
    for rows in (8, 8, 4):
        x, _ = split_workers.batches()[0]
        x = {key: value[:rows] for key, value in x.items()}
        out = second.run(x, first.run(x), chunk=0)
        assert torch.equal(out, model(**x))
    assert len(meta_calls) == 2  # the first forward of 8 rows and the one of 4


def test_only_arguments_that_say_all_a_shape_depends_on_are_remembered():
    from paratrain.parallel.pipeline.stage_run import argument_signature

    class Cache:  # stands for Hugging Face's key-value cache base class
        pass

    class DynamicCache(Cache):
        pass

    tensor = torch.zeros(2, 3)
    assert argument_signature((tensor, None, 3, "x")) == argument_signature(
        (torch.ones(2, 3), None, 3, "x")
    )
    assert argument_signature((tensor,)) != argument_signature((torch.zeros(3, 3),))
    assert argument_signature({"cache": DynamicCache(), "x": tensor}) is not None
    assert argument_signature({"cache": DynamicCache()}, caches=False) is None  # an output
    assert argument_signature((tensor, object())) is None
