"""Mixed precision: bf16 autocast and fp16 with dynamic loss scaling, in every engine.

Tolerances (``tolerance``): dp and pipeline against single run the same ``PARITY_STEPS``
(10) bf16/fp16 SGD steps, but each rounds its own gradients: single rounds a weight
gradient summed over the whole batch once, dp once per half-batch share and pipeline once
per micro-batch, before the fp32 average. Each side is within the format's unit
roundoff u (bf16 2^-8, fp16 2^-11) of the exact gradient, so the two differ by up to 2u
relative per step, where ``low_precision_tolerance`` counts u for engines whose only
difference is an fp32 reorder; its argument (an update at most the parameters' size
carries a relative gradient change into them, step by step) gives 10 * 2u: 7.8e-2 for
bf16, 9.8e-3 for fp16. Which values round which way depends on the CPU's kernels
(AVX-512, AVX2 and scalar code round bf16 matmuls differently), so the bound counts
roundings instead of quoting one machine (measured on AVX-512, AVX2 and
``ATEN_CPU_CAPABILITY=default``: bf16 <= 4.7e-3, fp16 <= 6.3e-4). A defect is far above
it: doubling the gradient or dropping a replica's share moves these parameters by 0.35
to 2.3. Losses are computed from those parameters and are held to the same bound
(measured: bf16 <= 1.3e-4, fp16 <= 7.1e-6); the same defects move them by only 0.7e-2
to 5.7e-2, so loss reporting is held to account by the fp32 tests (``TOLERANCE``), not
here. (fp32 runs agree within 1e-5, see test_parity_dp.py.)
"""

from __future__ import annotations

import pytest
import torch

import paratrain
from paratrain.parallel.precision import Precision
from tests import mem_workers, workers
from tests.test_parity_dp import low_precision_tolerance, relative_error

BF16_TOLERANCE = 2 * low_precision_tolerance("bf16", workers.PARITY_STEPS)  # 10 * 2 * 2^-8
FP16_TOLERANCE = 2 * low_precision_tolerance("fp16", workers.PARITY_STEPS)  # 10 * 2 * 2^-11
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
    """Relative bound for parameters and losses against single (derivation above)."""
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
    # Exact in principle (the same fp16 operations on the same bits, in the same order);
    # 1e-6, 16 fp32 unit roundoffs, is far below one fp16 rounding (2^-11 = 4.9e-4).
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
            assert got["losses"] == pytest.approx(ref["losses"], rel=tolerance(options))
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
    assert bf16["losses"] == pytest.approx(references[0]["losses"], rel=BF16_TOLERANCE)
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
