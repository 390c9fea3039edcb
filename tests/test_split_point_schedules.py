"""The schedules past 1F1B on models cut at named split points. Interleaved 1F1B
(``virtual_stages``): the model is cut into stages x v pieces at named blocks and each
worker holds v non-adjacent ones in one module tree, each chunk running the model's own
forward to its boundary. Zero bubble (``zb-h1``, ``zb-h2``): each piece's backward split
into B and W, W unit by unit where the piece's graph proves it exact.

Parity: the same fp32 operations as one process over the same parts (micro-batches x
replicas), only the order of the gradient sums differs (chunks and micro-batches
accumulate in another order, replicas all-reduce, GPT-2's tied head and embedding sum
over two stages), so the suite's fp32 bar ``TOLERANCE`` (1e-5 relative per tensor, see
``test_parity_dp``) applies to states and losses; the tensor split adds a rowwise layer's
products as two partial sums, as in tests/test_pp_tp_models.py (same bar, same Adam
exception for GPT-2's packed key bias, whose gradient is zero analytically).
"""

from __future__ import annotations

import pytest
import torch

import paratrain
from paratrain.parallel.pipeline.partition import PartitionError
from paratrain.parallel.pipeline.split_points import plan_stages
from paratrain.parallel.pipeline.stage_run import NamedStage
from tests import split_point_schedule_workers, split_workers
from tests.test_parity_dp import TOLERANCE, relative_error


def test_split_points_count_the_pieces_of_every_virtual_stage():
    model = split_workers.build()
    plan = plan_stages(model, 4, ["blocks.1", "blocks.2", "blocks.3"], virtual_stages=2)
    assert plan.owner["embed.weight"] == 0 and plan.owner["head.weight"] == 3
    assert [plan.owner[f"blocks.{i}.mix.weight"] for i in range(4)] == [0, 1, 2, 3]
    with pytest.raises(PartitionError, match="2 stages x 2 virtual stages need 3 split points"):
        plan_stages(model, 4, ["blocks.2"], virtual_stages=2)
    assert plan_stages(model, 4, None, virtual_stages=2).split_points == [
        "blocks.1",
        "blocks.2",
        "blocks.3",
    ]


def test_two_workers_pieces_run_in_turn_give_the_models_own_output():
    """Worker A holds pieces 0 and 2, worker B pieces 1 and 3 (2 stages x 2 virtual
    stages), each in its own copy of the model; passing each piece's output to the next
    gives the model's own forward to the bit, each block computed once, by its holder
    (a piece met before the running one runs on its meta twin)."""
    model = split_workers.build()
    x, _ = split_workers.batches()[0]
    expected = model(**x)
    plan = plan_stages(model, 4, None, virtual_stages=2)
    holders = [
        NamedStage(split_workers.build(), plan, [0, 2], torch.device("cpu")),
        NamedStage(split_workers.build(), plan, [1, 3], torch.device("cpu")),
    ]
    calls: list[str] = []
    for holder in holders:
        for index, block in enumerate(holder.model.blocks):
            block.mix.register_forward_hook(
                lambda module, args, out, index=index: (
                    None if module.weight.is_meta else calls.append(f"blocks.{index}")
                )
            )
    value = None
    for piece in range(4):
        holder, chunk = holders[piece % 2], piece // 2
        value = holder.run(x, value, chunk=chunk)
    assert torch.equal(value, expected)
    assert calls == [f"blocks.{i}" for i in range(4)]
    assert [n for n, _ in holders[0].named_parameters()] == [
        "embed.weight",
        "embed.bias",
        "blocks.0.norm.weight",
        "blocks.0.norm.bias",
        "blocks.0.mix.weight",
        "blocks.0.mix.bias",
        "blocks.2.norm.weight",
        "blocks.2.norm.bias",
        "blocks.2.mix.weight",
        "blocks.2.mix.bias",
    ]
    assert holders[1].model.embed.weight.is_meta and not holders[1].model.head.weight.is_meta


def _blocks_equal_the_plain_loop(two: list, four: list, hybrid: list) -> None:
    """Each (optimizer, options) of ``two`` on 2 workers (4 blocks), ``four`` on 4 (8
    blocks) and ``hybrid`` on 4 (2 replicas, 4 blocks) against the plain loop over the
    engine's parts (micro-batches x replicas)."""
    cases = [
        (two, paratrain.launch(split_workers.train_blocks, devices=2, args=(two,))[0], 4, 1),
        (four, paratrain.launch(split_workers.train_blocks, devices=4, args=(four, 8))[0], 8, 1),
        (hybrid, paratrain.launch(split_workers.train_blocks, devices=4, args=(hybrid,))[0], 4, 2),
    ]
    for runs, results, blocks, replicas in cases:
        for (opt, options), (state, losses) in zip(runs, results, strict=True):
            parts = options["micro_batches"] * replicas
            reference, reference_losses = split_workers.plain_loop(opt, parts, blocks)
            error = relative_error(state, reference)
            assert error <= TOLERANCE, (options, replicas, error)
            assert losses == pytest.approx(reference_losses, rel=TOLERANCE), (options, replicas)


@pytest.mark.slow
def test_interleaved_named_blocks_equal_the_plain_loop():
    """2 stages x 2 virtual stages (SGD-momentum and Adam, chosen and named split
    points, 4 and 8 micro-batches), 4 stages x 2 on 8 blocks, and 2 replicas x 2 stages x
    2, each against the plain loop over the engine's parts; every worker computes each
    of its blocks once per micro-batch, the others' never."""
    two = [
        ("sgd", {"stages": 2, "micro_batches": 4, "virtual_stages": 2}),
        (
            "adam",
            {
                "stages": 2,
                "micro_batches": 8,
                "virtual_stages": 2,
                "split_points": ["blocks.1", "blocks.2", "blocks.3"],
            },
        ),
    ]
    four = [("adam", {"stages": 4, "micro_batches": 8, "virtual_stages": 2})]
    hybrid = [("sgd", {"stages": 2, "micro_batches": 4, "virtual_stages": 2})]
    _blocks_equal_the_plain_loop(two, four, hybrid)
    options = {"stages": 2, "micro_batches": 4, "virtual_stages": 2}
    calls = paratrain.launch(
        split_point_schedule_workers.count_block_calls, devices=2, args=(4, options)
    )
    steps = len(split_workers.batches())
    assert calls == [
        {"blocks.0": 4 * steps, "blocks.2": 4 * steps},
        {"blocks.1": 4 * steps, "blocks.3": 4 * steps},
    ]


@pytest.mark.slow
def test_zero_bubble_named_blocks_equal_the_plain_loop():
    """ZB-H1 and ZB-H2 at 2 stages (SGD-momentum and Adam, 4 and 8 micro-batches) and at
    4 stages on 8 blocks, and ZB-H1 on 2 replicas x 2 stages, each against the plain loop
    over the engine's parts."""
    two = [
        ("sgd", {"stages": 2, "micro_batches": 4, "schedule": "zb-h1"}),
        ("adam", {"stages": 2, "micro_batches": 8, "schedule": "zb-h2"}),
    ]
    four = [
        ("adam", {"stages": 4, "micro_batches": 8, "schedule": "zb-h1"}),
        ("sgd", {"stages": 4, "micro_batches": 4, "schedule": "zb-h2"}),
    ]
    hybrid = [("adam", {"stages": 2, "micro_batches": 4, "schedule": "zb-h1"})]
    _blocks_equal_the_plain_loop(two, four, hybrid)


@pytest.mark.slow
def test_hugging_face_models_under_every_schedule_equal_their_own_loop(tmp_path):
    """GPT-2 (its head tied to the embedding, the two on different workers) and Llama, 4
    blocks, 2 stages, 4 micro-batches, under interleaved 1F1B (2 virtual stages), ZB-H1
    and ZB-H2, SGD-momentum and AdamW, against Hugging Face's own loss accumulated over
    the same 4 parts; each checkpoint loads strictly into a fresh model of the class, and
    each run's evaluation of a batch equals one process's on the reference weights.
    Under the zero-bubble schedules every micro-batch's graph passes the unit proof (no
    chunk took its W whole: W does not redo B on these models)."""
    pytest.importorskip("transformers", reason="the dev extra installs transformers")
    from tests import hf_workers
    from tests.test_hf_models import plain_loop

    layers = split_point_schedule_workers.LAYERS
    schedules = [{"virtual_stages": 2}, {"schedule": "zb-h1"}, {"schedule": "zb-h2"}]
    runs = [
        (kind, opt, {"stages": 2, "micro_batches": 4, **schedule})
        for schedule in schedules
        for kind in ("gpt2", "llama")
        for opt in ("sgd", "adam")
    ]
    launched = paratrain.launch(
        split_point_schedule_workers.train_hf, devices=2, args=(runs, str(tmp_path))
    )
    results, whole = launched[0][0], [rank_whole for _, rank_whole in launched]
    references = {
        (k, o): plain_loop(k, o, 4, layers) for k in ("gpt2", "llama") for o in ("sgd", "adam")
    }
    for index, ((kind, opt, options), (state, losses, path, layout, evaluated)) in enumerate(
        zip(runs, results, strict=True)
    ):
        if "virtual_stages" in options:
            assert layout["virtual_stages"] == 2 and len(layout["split_points"]) == 3, layout
        else:
            assert [rank_whole[index] for rank_whole in whole] == [[], []], (kind, options)
        reference, reference_losses = references[kind, opt]
        assert relative_error(state, reference) <= TOLERANCE, (kind, opt, options)
        assert losses == pytest.approx(reference_losses, rel=TOLERANCE), (kind, opt, options)
        fresh = hf_workers.build(kind, layers)
        fresh.load_state_dict(paratrain.load_model_state(path), strict=True)
        assert relative_error(dict(fresh.state_dict()), reference) <= TOLERANCE
        if kind == "gpt2":
            assert torch.equal(fresh.lm_head.weight, fresh.transformer.wte.weight)
        single = hf_workers.engine("single", kind, opt, layers=layers)
        single.load_state_dict(reference)
        expected = single.eval_step(*hf_workers.batches()[0])
        assert evaluated == pytest.approx(expected, rel=TOLERANCE), (kind, opt, options)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", [{"virtual_stages": 2}, {"schedule": "zb-h1"}])
def test_named_stages_split_their_blocks_over_a_tensor_group(schedule):
    """Llama, 4 blocks, 2 stages x tensor 2 on 4 workers (each worker splits the attention
    and MLP of its two blocks) under interleaved 1F1B and ZB-H1, SGD-momentum, against
    one process accumulating the same 4 micro-batches."""
    pytest.importorskip("transformers", reason="the dev extra installs transformers")
    options = {"stages": 2, "micro_batches": 4, "tensor": 2, **schedule}
    state, losses = paratrain.launch(
        split_point_schedule_workers.train_one,
        devices=4,
        args=("pipeline", "llama", "sgd"),
        kwargs=options,
    )[0]
    expected, expected_losses = split_point_schedule_workers.train_one(
        "single", "llama", "sgd", accumulation=4
    )
    assert relative_error(state, expected) <= TOLERANCE
    assert losses == pytest.approx(expected_losses, rel=TOLERANCE)
