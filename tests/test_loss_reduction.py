"""Token-mean losses with ignored labels are exact under every split: a loss_fn returning
(sum, count) gives the global-batch mean over real tokens, as one device computes it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import paratrain
from paratrain.losses import causal_lm_cross_entropy, token_cross_entropy
from paratrain.parallel.loss_reduction import LossReturnError, LossTotals, split_loss
from tests import loss_workers, workers
from tests.test_parity_dp import TOLERANCE, relative_error

CPU = torch.device("cpu")


def plain_loop(optimizer: str, parts: int = 1) -> tuple[dict, list[float]]:
    """One process, torch's own token mean (ignore_index=-100) over the whole global batch;
    with ``parts`` > 1 the batch is backpropagated in that many consecutive parts, each
    ``part_sum / N`` with N the global batch's token count, as a user accumulates by hand."""
    model = workers.parity_model("gpt")
    opt = loss_workers.optimizer_factory(optimizer)(model.parameters())
    losses = []
    for x, y in loss_workers.padded_batches():
        opt.zero_grad()
        count, loss = (y != -100).sum(), 0.0
        for xs, ys in zip(x.chunk(parts), y.chunk(parts), strict=True):
            logits = model(xs).reshape(-1, 11)
            if parts == 1:
                part = F.cross_entropy(logits, ys.reshape(-1))
            else:
                part = F.cross_entropy(logits, ys.reshape(-1), reduction="sum") / count
            part.backward()
            loss += float(part.detach())
        opt.step()
        losses.append(loss)
    model.eval()
    with torch.no_grad():
        x, y = loss_workers.padded_batches()[0]
        losses.append(float(F.cross_entropy(model(x).reshape(-1, 11), y.reshape(-1))))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


@pytest.fixture(scope="module")
def references() -> dict:
    """SGD against the unsplit loop; Adam against the loop accumulating in the engine's
    parts. Why Adam so: on these padded batches some parameters' gradients are mostly
    cancellation, and Adam's m / sqrt(v) turns the last-bit difference between summing a
    gradient in one pass and in 4 parts into a visible change of their updates. Two plain
    loops that differ only in that order end 2.4e-5 (2 parts) and 2.7e-5 (4 parts) apart
    after these 6 steps (SGD: 4e-7 and 5e-7; on unpadded batches, Adam: 4e-7), so against
    the unsplit loop the 1e-5 bar would test summation order, not paratrain. Added in the
    same order, the engines meet the suite's 1e-5."""
    return {
        (name, parts): plain_loop(name, parts)
        for name, parts in (("sgd", 1), ("adam", 1), ("adam", 2), ("adam", 4))
    }


def reference_for(references: dict, optimizer: str, parts: int) -> tuple:
    return references[(optimizer, 1 if optimizer == "sgd" else parts)]


def check(result: tuple, reference: tuple, label) -> None:
    state, losses = result
    error = relative_error(state, reference[0])
    assert error <= TOLERANCE, (label, error)
    assert losses == pytest.approx(reference[1], rel=TOLERANCE), label


def test_the_batches_are_padded_unevenly():
    """Guards the tests below: parts holding equal token counts would hide the defect."""
    _, y = loss_workers.padded_batches()[0]
    quarters = (y != -100).sum(dim=1).reshape(4, 4).sum(dim=1)
    assert len(set(quarters.tolist())) == 4, quarters


def test_the_token_losses_match_torchs_mean():
    logits, targets = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    targets[0, 3:] = -100
    total, count = token_cross_entropy({"logits": logits}, targets)
    assert int(count) == 8 == token_cross_entropy.count(targets)
    expected = F.cross_entropy(logits.reshape(-1, 7), targets.reshape(-1))
    # A sum of 8 positive terms, then a division, against torch's mean: reordering moves
    # the sum by at most 7 u and the division adds u, 8 x 2^-24 = 4.8e-7 < 1e-6.
    assert float(total / count) == pytest.approx(float(expected), rel=1e-6)
    total, count = causal_lm_cross_entropy(logits, targets)
    assert int(count) == 6 == causal_lm_cross_entropy.count(targets)
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, 7), targets[:, 1:].reshape(-1))
    assert float(total / count) == pytest.approx(float(expected), rel=1e-6)


def test_a_loss_return_that_is_neither_form_is_refused():
    with pytest.raises(LossReturnError, match="scalar tensor"):
        split_loss([torch.ones(())])
    totals = LossTotals(None, None, None, parts=2, device=CPU)
    totals.add(torch.ones(()))
    with pytest.raises(LossReturnError, match="same form"):
        totals.add((torch.ones(()), 3))


def test_a_summed_loss_needs_its_count_up_front():
    totals = LossTotals(lambda out, y: None, None, None, parts=1, device=CPU)
    with pytest.raises(LossReturnError, match=r"no count\(targets\) method"):
        totals.add((torch.ones(()), 3))


def test_a_count_that_disagrees_with_the_pairs_is_refused():
    targets = torch.tensor([[1, 2, -100]])
    totals = LossTotals(token_cross_entropy, targets, targets, parts=1, device=CPU)
    totals.add((torch.ones(()), 3))
    with pytest.raises(LossReturnError, match="counted 3 elements"):
        totals.contribution()


def test_a_per_part_mean_differs_from_the_global_token_mean(references):
    """What a plain mean loss means under splitting: the mean of equal parts' means, which
    for unevenly padded tokens is not the global token mean (said in docs/models.md)."""
    engine = workers.parity_engine("single", "gpt", "sgd", 4)
    engine.loss_fn = lambda out, y: F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    x, y = loss_workers.padded_batches()[0]
    expected = references[("sgd", 1)][1][0]
    # Must differ by more than the parity bar (the per-part mean is off by O(1e-2) here).
    assert engine.train_step(x, y).loss != pytest.approx(expected, rel=TOLERANCE)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("accumulation", [1, 4])
def test_single_with_accumulation_is_exact(references, optimizer, accumulation):
    result = loss_workers.train("single", optimizer, accumulation)
    check(result, reference_for(references, optimizer, accumulation), accumulation)


@pytest.mark.slow
def test_pipeline_micro_batches_and_replicas_are_exact(references):
    """One replica: 4 micro-batches backpropagated in order, as the 4-part loop, under
    1F1B, interleaved, ZB-H1 and ZB-H2 (whose W passes take the micro-batches in order
    too); GPipe with 2 accumulated; 2 replicas x 2 stages with SGD against the unsplit
    loop."""
    single_replica = [
        ("pipeline", "adam", 1, {"stages": 2, "micro_batches": 4}),
        ("pipeline", "sgd", 2, {"stages": 2, "micro_batches": 2, "schedule": "gpipe"}),
        ("pipeline", "adam", 1, {"stages": 2, "micro_batches": 4, "virtual_stages": 2}),
        ("pipeline", "adam", 1, {"stages": 2, "micro_batches": 4, "schedule": "zb-h1"}),
        ("pipeline", "sgd", 1, {"stages": 2, "micro_batches": 4, "schedule": "zb-h2"}),
    ]
    results = paratrain.launch(loss_workers.train_all, devices=2, args=(single_replica,))
    for run, result in zip(single_replica, results[0], strict=True):
        check(result, reference_for(references, run[1], 4), run)
    hybrid = [("pipeline", "sgd", 1, {"stages": 2, "micro_batches": 2})]
    results = paratrain.launch(loss_workers.train_all, devices=4, args=(hybrid,))
    check(results[0][0], references[("sgd", 1)], hybrid[0])


@pytest.mark.slow
def test_replicas_are_exact_under_dp_and_zero(references):
    """2 replicas (synchronous ps: 2 workers): Adam against the 2-part loop (two parts'
    gradients add in either order to the same bits), SGD against the unsplit loop;
    accumulation 2 with SGD; the synchronous ps round reports the global loss too."""
    runs = [
        (strategy, optimizer, accumulation, {})
        for strategy in ("dp", "zero1", "zero2", "zero3", "ps")
        for optimizer, accumulation in (("adam", 1), ("sgd", 2))
    ]
    results = paratrain.launch(loss_workers.train_all, devices=2, args=(runs,))
    for run, result in zip(runs, results[0], strict=True):
        check(result, reference_for(references, run[1], 2), run)
