"""Mixed precision: bf16 autocast and fp16 with dynamic loss scaling, in every engine.

Tolerances: bf16 keeps 8 bits of mantissa, so a replica's gradient (computed on half the
batch, rounded, then averaged) differs from the single-device one by about 2^-8
relative; after 10 SGD steps the parameters agree within ``BF16_TOLERANCE``. fp16 keeps
11 bits: ``FP16_TOLERANCE``. Losses agree within ``LOSS_TOLERANCE`` relative. (fp32 runs
agree within 1e-5, see test_parity_dp.py; measured here: bf16 <= 4.5e-3, fp16 <= 4.7e-4.)
"""

from __future__ import annotations

import pytest
import torch

import paratrain
from paratrain.parallel.precision import Precision
from tests import mem_workers, workers
from tests.test_parity_dp import relative_error

BF16_TOLERANCE = 1e-2
FP16_TOLERANCE = 2e-3
LOSS_TOLERANCE = 1e-3
FORCED = 2.0**24  # an initial loss scale that overflows fp16 gradients for several steps

PARITY = [
    (("mlp", "sgd", "parity"), {"precision": "bf16"}),
    (("gpt", "sgd", "parity"), {"precision": "bf16"}),
    (("mlp", "sgd", "parity"), {"precision": "fp16"}),
    (("gpt", "sgd", "parity"), {"precision": "fp16"}),
]
LEARNS = [
    (("mlp", "adam", "memo"), {"precision": "bf16"}),
    (("mlp", "adam", "memo"), {"precision": "fp16"}),
]
OVERFLOW = [(("gpt", "adam", "memo"), {"precision": Precision("fp16", init_scale=FORCED)})]
PIPELINE_OVERFLOW = (("mlp", "adam", "memo"), {"precision": Precision("fp16", init_scale=FORCED)})


def tolerance(options: dict) -> float:
    return BF16_TOLERANCE if options["precision"] == "bf16" else FP16_TOLERANCE


# ---- the Precision object ---------------------------------------------------------------


def test_unknown_precision_is_refused_at_setup():
    with pytest.raises(ValueError, match="precision must be one of fp32, bf16, fp16, not 'fp8'"):
        workers.parity_engine("single", "mlp", "sgd", precision="fp8")


def test_unscale_and_check_unscales_finite_gradients_and_skips_overflow():
    precision = Precision("fp16", init_scale=8.0, growth_interval=2)
    grads = [torch.full((3,), 16.0), None, torch.full((2,), 8.0)]
    assert precision.unscale_and_check(grads)
    assert torch.equal(grads[0], torch.full((3,), 2.0)) and torch.equal(grads[2], torch.ones(2))
    assert precision.scale == 8.0 and precision.skipped_steps == 0
    assert not precision.unscale_and_check([torch.tensor([1.0, float("inf")])])
    assert not precision.unscale_and_check([torch.tensor([float("nan")])])
    assert precision.scale == 2.0 and precision.skipped_steps == 2
    assert precision.unscale_and_check([torch.ones(1)])
    assert precision.unscale_and_check([torch.ones(1)])  # two clean steps in a row: grow
    assert precision.scale == 4.0


def test_bf16_and_fp32_neither_scale_nor_check():
    for name in ("bf16", "fp32"):
        precision = Precision(name)
        grads = [torch.tensor([float("inf")])]
        assert precision.unscale_and_check(grads) and precision.skipped_steps == 0
        assert precision.scale == 1.0 and torch.isinf(grads[0]).all()


def test_state_round_trips_and_instances_are_copied_per_engine():
    precision = Precision("fp16", init_scale=4.0)
    precision.unscale_and_check([torch.tensor([float("inf")])])
    restored = Precision("fp16")
    restored.load_state_dict(precision.state_dict())
    assert (restored.scale, restored.skipped_steps) == (2.0, 1)
    with pytest.raises(ValueError, match="resume it with precision='fp16'"):
        Precision("bf16").load_state_dict(precision.state_dict())
    engine = workers.parity_engine("single", "mlp", "sgd", precision=precision)
    assert engine.precision is not precision and engine.precision.scale == 2.0


# ---- single engine ----------------------------------------------------------------------


def test_fp16_overflow_skips_the_step_and_backs_off_the_scale():
    result = mem_workers.run_engine("single", "gpt", "adam", "memo", **OVERFLOW[0][1])
    skipped, scales, losses = result["skipped"], result["scales"], result["losses"]
    assert skipped[0] == 1, "a 2^24 loss scale must overflow fp16 gradients on step 1"
    assert all(s == FORCED * 0.5**k for s, k in zip(scales, skipped, strict=True))
    assert skipped[-1] < len(skipped), "the scale never came down far enough to train"
    assert losses[-1] < losses[0] - 0.1, "steps after the back-off must train"
    # A skipped step changes nothing: the first step's loss repeats on the same batch.
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    one = workers.parity_engine("single", "gpt", "adam", precision=OVERFLOW[0][1]["precision"])
    before = one.state_dict()
    x, y = mem_workers.memo_batches("gpt", 1)[0]
    assert one.train_step(x, y).skipped_steps == 1
    assert all(torch.equal(before[k], v) for k, v in one.state_dict().items())


def test_fp16_loss_scale_survives_a_checkpoint(tmp_path):
    options = {"precision": Precision("fp16", init_scale=FORCED)}
    engine = workers.parity_engine("single", "gpt", "adam", **options)
    for x, y in mem_workers.memo_batches("gpt", 3):
        engine.train_step(x, y)
    engine.save_checkpoint(tmp_path / "ckpt")
    resumed = workers.parity_engine("single", "gpt", "adam", precision="fp16")
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.precision.scale == engine.precision.scale == FORCED / 8
    assert resumed.precision.skipped_steps == 3


# ---- dp and pipeline --------------------------------------------------------------------


@pytest.fixture(scope="module")
def references() -> list[dict]:
    return mem_workers.run_cases("single", PARITY + LEARNS + OVERFLOW)


@pytest.mark.slow
def test_dp_mixed_precision_matches_single_learns_and_skips_together(references):
    cases = PARITY + LEARNS + OVERFLOW
    ranks = paratrain.launch(mem_workers.run_cases, devices=2, args=("dp", cases))
    for (case, options), ref, got in zip(cases, references, ranks[0], strict=True):
        if case[2] == "parity":
            error = relative_error(got["state"], ref["state"])
            assert error <= tolerance(options), f"{case} {options}: relative error {error:.2e}"
            assert got["losses"] == pytest.approx(ref["losses"], rel=LOSS_TOLERANCE)
        elif case[2] == "memo" and (case, options) in LEARNS:
            assert got["losses"][-1] < 0.8 * got["losses"][0], (case, options, got["losses"])
    # Replicas see the same averaged gradients, so they skip the same steps. (Which steps
    # near the threshold overflow may differ from the single device's: other rounding.)
    forced = [rank[-1] for rank in ranks]
    assert forced[0]["skipped"] == forced[1]["skipped"] and forced[0]["skipped"][0] == 1
    assert forced[0]["scales"] == forced[1]["scales"]
    assert forced[0]["losses"][-1] < forced[0]["losses"][0] - 0.1


@pytest.mark.slow
def test_an_overflow_on_one_worker_skips_the_step_on_all():
    assert paratrain.launch(mem_workers.vote_on_overflow, devices=2) == [
        [False, True],
        [False, False],
    ]


@pytest.mark.slow
def test_pipeline_stages_vote_on_skipping_and_bf16_matches_single(references):
    cases = [PARITY[0], PIPELINE_OVERFLOW]
    options = [{**opts, "stages": 2, "micro_batches": 4} for _, opts in cases]
    stage_results = paratrain.launch(
        mem_workers.pipeline_cases, devices=2, args=([case for case, _ in cases], options)
    )
    bf16, forced = stage_results[0]
    assert relative_error(bf16["state"], references[0]["state"]) <= BF16_TOLERANCE
    assert bf16["losses"] == pytest.approx(references[0]["losses"], rel=LOSS_TOLERANCE)
    stage0, stage1 = forced, stage_results[1][1]
    assert stage0["skipped"] == stage1["skipped"] and stage0["skipped"][0] == 1
    assert stage0["state"].keys() != stage1["state"].keys()  # two stages, two parameter sets
    assert stage0["scales"] == stage1["scales"]
    assert stage0["losses"][-1] < stage0["losses"][0] - 0.1


@pytest.mark.gpu
def test_mixed_precision_on_cuda_learns_and_skips_overflowing_steps():
    devices = min(2, torch.cuda.device_count())
    ranks = paratrain.launch(mem_workers.run_cases, devices=devices, args=("dp", LEARNS + OVERFLOW))
    for rank in ranks:
        for result in rank[: len(LEARNS)]:
            assert result["losses"][-1] < 0.8 * result["losses"][0], result["losses"]
        forced = rank[-1]
        assert forced["skipped"][0] == 1 and forced["skipped"][-1] < len(forced["skipped"])
        assert forced["losses"][-1] < forced["losses"][0] - 0.1
    assert all(rank[-1]["skipped"] == ranks[0][-1]["skipped"] for rank in ranks)
