"""Split layers composed with the other strategies: ``tensor`` under dp, zero1, zero2 and the
pipeline, up to data x pipeline x tensor on 8 workers, each equal to one device; canonical
checkpoints through those layouts; the share a worker holds; the refusals.

Tolerance: ``TOLERANCE`` (1e-5 relative on parameters after 10 steps, losses alike), the
suite's fp32 parity bar, derived in tests/test_parity_dp.py from the reordered sums of a
step. A tensor group adds one more reordering of the same kind, a rowwise layer's output
summed over the members' partial products (and a colwise layer's input gradient over
theirs): a sum of ``tensor`` partial sums instead of one matmul's, inside the same
per-step bound of 16 fp32 units (the parity batch's size; tensor <= 4 terms per sum).
The pipeline's micro-batches and the replicas' all-reduce reorder as under pipeline and
dp alone. A defect (a slice cut from the wrong model, a replicated gradient counted
twice, a stage sending to the wrong tensor rank) moves the weights by 1e-2 or more.
"""

from __future__ import annotations

import pytest

import paratrain
from paratrain.parallel import RunSpec, strategy_class
from tests import tensor_workers, tp_workers
from tests.test_parity_dp import TOLERANCE, relative_error
from tests.test_tp import PAIRS, assert_forward_all_reduces

REPLICA_CASES = [
    ("mlp", "sgd", 1, {"recompute": True}),
    ("gpt", "adam", 2, {"recompute": True}),
    ("updown", "adam", 1, {"max_grad_norm": 0.1}),
    ("updown", "sgd", 2, {}),
]
"""dp and ZeRO: recompute on the layer lists (each segment's forward, its all-reduce
included, runs again in backward), accumulation, the user's own model split by patterns
with clipping (split slices' squares summed over the tensor group, replicated ones once)."""

PIPELINE_CASES = [
    ("mlp", "adam", 1, {}),
    ("gpt", "adam", 2, {"recompute": True}),
    ("updown_seq", "sgd", 1, {"max_grad_norm": 0.1}),
    ("gpt", "sgd", 1, {"schedule": "gpipe"}),
]
"""The pipeline cuts layer lists: mlp (its colwise layer and its rowwise partner may land on
different stages: the slice crosses the boundary), gpt, and the user's blocks as an
``nn.Sequential``; 2 micro-batches a step so that 2 replicas x 2 micro-batches x 2
accumulation rounds divide gpt's 8 samples."""

LAYOUTS = [
    ("dp", 4, {"tensor": 2}, REPLICA_CASES),
    ("zero1", 4, {"tensor": 2}, REPLICA_CASES),
    ("zero2", 4, {"tensor": 2}, REPLICA_CASES[1:3]),
    ("pipeline", 4, {"stages": 2, "tensor": 2, "micro_batches": 2}, PIPELINE_CASES),
    ("pipeline", 8, {"stages": 2, "tensor": 2, "micro_batches": 2}, PIPELINE_CASES[1:3]),
]
"""(strategy, workers, layout, cases): dp x tp 2x2, zero1/zero2 x tp 2x2, pipeline x tp
2x2 and data x pipeline x tensor 2x2x2."""


def _cases(layout: dict, cases: list[tuple]) -> list[tuple]:
    return [(kind, opt, acc, {**layout, **extra}) for kind, opt, acc, extra in cases]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "devices", "layout", "cases"),
    LAYOUTS,
    ids=["dp-x-tp", "zero1-x-tp", "zero2-x-tp", "pipeline-x-tp", "dp-x-pipeline-x-tp"],
)
def test_every_composition_equals_one_device(strategy, devices, layout, cases):
    cases = _cases(layout, cases)
    references = [tensor_workers.train("single", case)[:2] for case in cases]
    results = paratrain.launch(
        tensor_workers.parity_worker, devices=devices, args=(strategy, cases)
    )[0]
    for case, (state, losses, calls, held), (reference, reference_losses) in zip(
        cases, results, references, strict=True
    ):
        error = relative_error(state, reference)
        assert error <= TOLERANCE, f"{strategy} {case}: relative error {error:.2e}"
        assert losses == pytest.approx(reference_losses, rel=TOLERANCE), case
        kind, _, accumulation, options = case
        whole = sum(p.numel() for p in tensor_workers.build(kind).parameters())
        assert held < whole, f"{case}: rank 0 holds all {whole} parameters: nothing split"
        if strategy != "pipeline":  # a stage holds only some of the pairs
            assert_forward_all_reduces(calls, PAIRS[kind] * accumulation, options, case)
        elif kind != "mlp":  # rank 0, the first stage, holds blocks (mlp's may be only f)
            assert calls["forward"] > 0 and calls["backward"] > 0, f"{case}: {calls}"


@pytest.mark.slow
def test_a_worker_holds_one_tensor_share_of_each_split_layer():
    """The user's model: per block, up (weight and bias) and down's weight split, the
    rest whole; at tensor 2 and 4 a worker holds exactly the whole minus (1 - 1/t) of
    the split ones, its ledger books those bytes, and the summary's figures say so."""
    model = tp_workers.build("updown")
    split = sum(
        block.up.weight.numel() + block.up.bias.numel() + block.down.weight.numel()
        for block in model.blocks
    )
    whole = sum(p.numel() for p in model.parameters())
    for tensor in (2, 4):
        case = ("updown", "sgd", 1, {"tensor": tensor})
        held = paratrain.launch(tensor_workers.held_worker, devices=4, args=("tp", case))
        for count, ledger, metrics in held:
            assert count == whole - split + split // tensor
            assert ledger["parameters"] == 4 * count
            assert metrics["parameters_per_worker"] == count
            assert metrics["parameters"] == whole
            assert (
                metrics["mesh"] == f"{4 // tensor} replica{'s' if tensor == 2 else ''} x "
                f"{tensor} tensor"
            )


@pytest.mark.slow
def test_a_checkpoint_travels_through_the_three_dimensional_layouts(tmp_path):
    """single -> pipeline x tp -> zero2 x tp -> data x pipeline x tp -> tp 4 -> single,
    Adam (its moments are cut and joined with their parameters), equal to single
    uninterrupted; values compared, not only shapes."""
    kind, opt = "gpt", "adam"
    legs = [
        ("single", 1, [0, 1], {}),
        ("pipeline", 4, [2, 3], {"stages": 2, "tensor": 2, "micro_batches": 2}),
        ("zero2", 4, [4, 5], {"tensor": 2}),
        ("pipeline", 8, [6], {"stages": 2, "tensor": 2, "micro_batches": 2}),
        ("tp", 4, [7], {}),
        ("single", 1, [8, 9], {}),
    ]
    previous = None
    for index, (strategy, devices, steps, options) in enumerate(legs):
        save = str(tmp_path / f"leg{index}")
        args = (strategy, kind, opt, previous, save, steps, options)
        if devices == 1:
            state = tensor_workers.chain_worker(*args)
        else:
            state = paratrain.launch(tensor_workers.chain_worker, devices=devices, args=args)[0]
        previous = save
    reference = tensor_workers.engine("single", kind, opt)
    for x, y in tensor_workers.batches(kind, 10):
        reference.train_step(x, y)
    error = relative_error(state, reference.state_dict())
    assert error <= TOLERANCE, f"relative error {error:.2e} after the chain"


def test_meshes_that_do_not_fit_are_refused_before_any_worker_starts():
    build = lambda: tensor_workers.build("gpt").to("meta")  # noqa: E731
    run = RunSpec(devices=6, global_batch=8, options={"stages": 2, "tensor": 2}, build_model=build)
    with pytest.raises(ValueError, match=r"2 stages x tensor 2 = 4 workers per replica do not"):
        strategy_class("pipeline").check_run(run)
    run = RunSpec(devices=4, global_batch=8, options={"tensor": 3}, build_model=build)
    with pytest.raises(ValueError, match=r"tensor=3 does not divide 4 workers"):
        strategy_class("zero1").check_run(run)
    heads = RunSpec(devices=8, global_batch=8, options={"tensor": 8}, build_model=build)
    with pytest.raises(ValueError, match=r"has 4 heads, which tensor=8 does not divide"):
        strategy_class("dp").check_run(heads)


@pytest.mark.slow
def test_what_cannot_split_is_refused_in_the_workers():
    errors = paratrain.launch(tensor_workers.refusals_worker, devices=2)
    assert errors[0] == [
        "zero3 does not split layers over a tensor group; use zero1 or zero2 with tensor, "
        "or zero3 without it.",
        "group and tensor cannot be combined: the tensor degree lays out the replicas' "
        "groups itself; leave group out.",
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "mesh"),
    [
        (["--strategy", "pipeline", "--stages", "2"], "1 replica x 2 stages x 2 tensor"),
        (["--strategy", "zero2"], "2 replicas x 2 tensor"),
    ],
)
def test_the_command_line_takes_tensor_and_prints_the_mesh(tmp_path, capsys, flags, mesh):
    from paratrain.cli import main

    args = ["train", "--no-progress", "--model", "gpt", "--dataset", "synthetic_tokens"]
    args += ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "16"]
    args += ["--devices", "4", "--tensor", "2", "--steps", "2", "--global-batch", "8"]
    args += ["--run-dir", str(tmp_path / "run"), *flags]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"  mesh              {mesh} (" in out
    assert "(split layers 1/2 each)" in out
