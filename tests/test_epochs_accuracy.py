"""``--epochs``, accuracy and a whole-split evaluation (the multi-GPU tutorial recipe).

Tolerances: counts and accuracies are compared exactly (they are integer counts, and the
reference's logits keep every top-two gap above 1e-4, far above the ~1e-6 by which
float32 logits of the same rows may differ between batchings, so no argmax can flip).
Losses compare at rel 1e-5: each sample's float32 cross-entropy over 5 classes is within
about 10 float32 epsilons (1.2e-7 each) of the float64 reference, and the engines add at
most 8 of them in float32 before summing in float64, another 8 epsilons: ~2.2e-6, below
1e-5.
"""

from __future__ import annotations

import pytest
import torch

import paratrain
from paratrain.cli import main
from paratrain.config import ConfigError, TrainConfig, build_config
from paratrain.data import whole_split
from paratrain.losses import token_cross_entropy
from paratrain.parallel.metric_tally import ObservedLoss
from paratrain.reports.metrics_file import read_metrics
from paratrain.run.build import make_optimizer
from paratrain.run.length import eval_batches, evaluates_at, run_length
from paratrain.run.metrics import ClassificationSums
from tests import metric_workers

LOSS_REL = 1e-5  # derived in the module docstring


def test_epochs_become_steps_from_the_training_split():
    """The tutorial's numbers: 60000 Fashion-MNIST images at 256 a step, 4 epochs."""
    config = TrainConfig(model="lenet", dataset="fashion_mnist", global_batch=256, epochs=4)
    length = run_length(config, 60000)
    assert (length.steps_per_epoch, length.steps) == (234, 936)  # 60000 // 256 = 234
    assert [length.epoch_of(s) for s in (1, 234, 235, 936)] == [1, 1, 2, 4]
    assert [s for s in range(1, 937) if evaluates_at(config, length, s)] == [234, 468, 702, 936]
    assert eval_batches(config, length) is None, "a run by epochs evaluates the whole split"
    assert length.where(470) == "epoch 3/4 · step 470"
    by_steps = run_length(TrainConfig(global_batch=256), 60000)
    assert by_steps.steps == 300 and by_steps.epochs is None
    assert eval_batches(TrainConfig(), by_steps) == 4
    assert [s for s in range(1, 301) if evaluates_at(TrainConfig(), by_steps, s)] == [100, 200, 300]


def test_steps_with_epochs_is_refused_in_one_sentence():
    with pytest.raises(ConfigError, match="pass only one of them"):
        build_config({}, {"steps": "10", "epochs": "2"})
    with pytest.raises(ConfigError, match="pass only one of them"):
        TrainConfig(steps=10, epochs=2)
    with pytest.raises(ConfigError, match="epochs must be at least 1"):
        TrainConfig(epochs=0)


def test_eval_batches_takes_a_count_or_all():
    assert build_config({}, {"eval_batches": "all"}).eval_batches == "all"
    assert build_config({"eval_batches": "ALL"}).eval_batches == "all"
    assert build_config({"eval_batches": 3}).eval_batches == 3
    with pytest.raises(ConfigError, match="eval_batches must be an integer or all"):
        build_config({}, {"eval_batches": "most"})
    with pytest.raises(ConfigError, match="at least 1 or all"):
        TrainConfig(eval_batches=0)


def test_sgd_default_momentum_is_torchs_zero():
    config = TrainConfig(optimizer="sgd", lr=0.2)
    assert config.momentum == 0.0
    optimizer = make_optimizer(config)([torch.nn.Parameter(torch.zeros(2))])
    assert optimizer.param_groups[0]["momentum"] == 0.0
    assert optimizer.defaults == torch.optim.SGD([torch.zeros(1)], lr=0.2).defaults


@pytest.mark.parametrize(("samples", "global_batch"), [(33, 8), (32, 8), (5, 8)])
def test_whole_split_yields_every_sample_once_with_its_real_rows(samples, global_batch):
    """33 = 4 x 8 + 1 (a last batch of one real row), 32 (divides), 5 (under one batch)."""
    split = metric_workers.classification_split(samples)
    parts = list(whole_split(split, global_batch))
    assert all(batch[0].shape[0] == global_batch for batch, _ in parts), "engines need whole"
    real = torch.cat([batch[0][:count] for batch, count in parts])
    assert torch.equal(real, split.tensors[0])
    assert sum(count for _, count in parts) == samples


@pytest.mark.slow
def test_accuracy_and_loss_equal_a_plain_count_at_two_workers():
    """33 test samples at a global batch of 8: the last batch holds one real row, so under
    dp one replica's share is padding only, and under the pipeline (2 stages, 2
    micro-batches; rank 0 is a first stage, which never sees a prediction) one
    micro-batch is. ps workers each evaluate the whole batch and count their own share
    of a training step."""
    samples, global_batch = 33, 8
    reference = metric_workers.plain_figures(samples)
    first_batch = metric_workers.plain_figures(samples, rows=global_batch)
    assert reference["gap"] > 1e-4, "a near tie could flip an argmax between batchings"
    assert 0 < reference["accuracy"] < 1 and 0 < first_batch["accuracy"] < 1, "must tell"
    runs = [
        ("dp", {}),
        ("zero3", {}),
        ("pipeline", {"stages": 2, "micro_batches": 2}),
        ("ps", {"staleness": 0}),
    ]
    results = paratrain.launch(
        metric_workers.engine_figures, devices=2, args=(runs, samples, global_batch)
    )
    for rank, per_rank in enumerate(results):
        for (strategy, _), got in zip(runs, per_rank, strict=True):
            where = (strategy, rank)
            assert got["count"] == samples, where
            assert got["accuracy"] == reference["accuracy"], where
            assert got["loss"] == pytest.approx(reference["loss"], rel=LOSS_REL), where
            share = global_batch // 2 if strategy == "ps" else global_batch
            assert got["train_count"] == share, where
            if strategy != "ps":
                assert got["train_correct"] == first_batch["accuracy"] * global_batch, where


@pytest.mark.slow
def test_the_console_prints_each_evaluation_and_metrics_hold_accuracy(tmp_path, capfd):
    """4096 training samples at 384 a step: 10 steps an epoch; the 512 test samples are
    one whole batch and a short one of 128."""
    run_dir = tmp_path / "run"
    code = main(
        [
            "train",
            *("--model", "mlp", "--dataset", "synthetic", "--devices", "2"),
            *("--global-batch", "384", "--epochs", "2", "--optimizer", "sgd", "--lr", "0.2"),
            *("--hidden", "16", "--depth", "1", "--log-every", "5", "--run-dir", str(run_dir)),
        ]
    )
    out, err = capfd.readouterr()
    assert code == 0, err
    lines = [line for line in out.splitlines() if " · eval loss " in line]
    assert [line.split(" · eval")[0] for line in lines] == [
        "epoch 1/2 · step 10",
        "epoch 2/2 · step 20",
    ]
    assert all(line.endswith("(512 samples)") and "accuracy " in line for line in lines)
    assert "20 steps (2 epochs)" in out and "final accuracy" in out
    # The bar (stderr, not a terminal here) counts steps and shows the epoch, and in a log
    # redraws every 10 s, around each eval line and at the end, not once per step (it
    # once wrote 20 lines here, one a step).
    renders = err.replace("\r", "\n").split("train mlp/dp:")[1:]
    assert "20/20" in renders[-1] and "epoch=2/2" in renders[-1], err
    assert len(renders) <= 8, err
    records = read_metrics(run_dir / "metrics.jsonl")
    evals = [r for r in records if r["kind"] == "eval"]
    assert [(r["step"], r["epoch"], r["samples"]) for r in evals] == [(10, 1, 512), (20, 2, 512)]
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in evals)
    train = [r for r in records if r["kind"] == "train"]
    assert [(r["step"], r["epoch"]) for r in train] == [(5, 1), (10, 1), (15, 2), (20, 2)]
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in train)


def test_a_tally_inside_another_takes_the_pairs_until_it_closes():
    """On one process (single): the evaluation's tally, opened inside the training one,
    keeps the evaluation's predictions out of the running train accuracy; the wrapped loss
    still offers a summed loss's count(targets) to the engines' loss reduction."""
    split = metric_workers.classification_split(16)
    engine = paratrain.setup(
        metric_workers.model(),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        loss_fn=torch.nn.functional.cross_entropy,
        strategy="single",
    )
    inputs, targets = split.tensors
    train = engine.tally(ClassificationSums())
    with engine.tally(ClassificationSums()) as inner:
        engine.eval_step(inputs, targets)
    engine.train_step(inputs[:8], targets[:8])
    train.close()
    engine.eval_step(inputs, targets)  # after close: counted nowhere
    assert engine.tally_totals(inner)["count"] == 16
    assert engine.tally_totals(train)["count"] == 8
    expected = metric_workers.plain_figures(16, rows=8)["accuracy"] * 8
    assert engine.tally_totals(train)["correct"] == expected
    assert ObservedLoss(token_cross_entropy).count(torch.tensor([[1, -100, 2]])) == 2
