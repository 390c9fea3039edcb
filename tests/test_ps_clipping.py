"""Gradient clipping under ps: synchronous rounds clip the global batch's gradient by its
norm over every server's shard, as ``clip_grad_norm_`` in the plain loop; asynchronous
pushes are each clipped by their own norm; backup workers refuse clipping."""

from __future__ import annotations

import pytest
import torch

import paratrain
from paratrain.config import ConfigError, TrainConfig
from paratrain.models import loss_for
from paratrain.parallel.batching import take_share
from paratrain.reports.metrics_file import read_metrics
from paratrain.run.preflight import check_config
from tests import clip_workers, ps_clip_workers, workers
from tests.test_cli_ps import MLP
from tests.test_cli_train import run_cli
from tests.test_clipping import plain_loop
from tests.test_parity_dp import TOLERANCE, relative_error

# Tolerances. States: the suite's parity bar, 1e-5 relative. The clipped round differs from
# the plain loop's step only in float32 roundings: the mean of the shares' mean gradients
# against the batch's mean (a few units of 2**-24 = 6e-8 per entry), and the norm, which
# the servers add up in float64 while torch reduces a few hundred float32 terms pairwise
# (log2(n) ~ 10 roundings, ~6e-7 relative). The coefficient inherits that 6e-7; an SGD
# step moves the parameters by lr x max_norm = 0.01 against parameter norms of order 1,
# and Adam's step hardly depends on the gradient's scale, so 10 steps stay below 1e-6 of
# the parameters: 1e-5 leaves a margin of ten. Norms: the same 6e-7 per step plus the
# states' difference of the steps before (below 1e-6) carried into the gradient: 1e-5.
NORM_TOLERANCE = 1e-5

SYNCHRONOUS = {
    2: [
        ("mlp", "sgd", {}),
        ("mlp", "adam", {"servers": 2}),
        ("gpt", "sgd", {"servers": 2, "transport": "gloo"}),
    ],
    4: [("mlp", "adam", {}), ("gpt", "adam", {"servers": 2})],
}


@pytest.mark.slow
@pytest.mark.parametrize("devices", sorted(SYNCHRONOUS))
def test_synchronous_rounds_clip_as_the_plain_loop(devices):
    cases = SYNCHRONOUS[devices]
    results = paratrain.launch(ps_clip_workers.synchronous, devices=devices, args=(cases,))
    for index, (kind, optimizer, options) in enumerate(cases):
        state, norms = plain_loop(kind, optimizer)
        # Every step clipped: a run that ignored max_grad_norm would fail the states.
        assert min(norms) > clip_workers.MAX_NORM, (kind, optimizer)
        for rank, rank_results in enumerate(results):
            got_state, got_norms = rank_results[index]
            label = (kind, optimizer, options, rank)
            assert relative_error(got_state, state) <= TOLERANCE, label
            assert got_norms == pytest.approx(norms, rel=NORM_TOLERANCE), label


def share_gradient(
    params: dict, x: torch.Tensor, y: torch.Tensor
) -> tuple[list[torch.Tensor], float]:
    """The gradient of the mean loss on (x, y) at ``params``, clipped by torch's own
    ``clip_grad_norm_``, and the norm before clipping."""
    model = workers.parity_model("mlp")
    model.load_state_dict(params, strict=False)
    loss_for("mlp")(model(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip_workers.MAX_NORM)
    return [p.grad for p in model.parameters()], float(norm)


@pytest.mark.slow
def test_asynchronous_pushes_are_each_clipped_by_their_own_norm():
    """Plain SGD at a constant rate: the servers' final parameters are the start minus lr
    times the sum of every push, whatever order they arrived in, so each push's clipped
    gradient is recomputed here from the parameters its worker computed on.

    Tolerance 1e-5 relative: 20 float32 updates of the parameters (each rounding at most
    2**-24 of them, 1.2e-6 in all) and gradients recomputed in another process (same
    operations, possibly another reduction order: 1e-6 of an update that is itself
    lr x max_norm = 0.01 of the parameters)."""
    devices = 2
    results = paratrain.launch(
        ps_clip_workers.asynchronous, devices=devices, args=({"staleness": None},)
    )
    model = workers.parity_model("mlp")
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    names = list(expected)
    for rank, result in enumerate(results):
        for (pulled, reported), (x, y) in zip(
            result["steps"], workers.parity_batches("mlp"), strict=True
        ):
            x, y = take_share(x, rank, devices), take_share(y, rank, devices)
            grads, norm = share_gradient(pulled, x, y)
            assert norm > clip_workers.MAX_NORM, "a push that needed no clipping tests nothing"
            assert reported == pytest.approx(norm, rel=NORM_TOLERANCE), (rank, reported, norm)
            for name, grad in zip(names, grads, strict=True):
                expected[name] -= ps_clip_workers.ASYNC_LR * grad
    for result in results:
        final = {n: result["final"][n] for n in names}
        assert relative_error(final, expected) <= TOLERANCE


def test_backup_workers_refuse_clipping_before_workers_start():
    config = TrainConfig(
        model="mlp",
        strategy="ps",
        devices=2,
        max_grad_norm=1.0,
        staleness=0,
        backup_workers=1,
    )
    with pytest.raises(ConfigError, match="cannot clip by the global gradient norm with backup"):
        check_config(config)


@pytest.mark.slow
def test_the_command_line_clips_a_synchronous_ps_run(tmp_path, capsys):
    run_dir = tmp_path / "clip"
    code, _, err = run_cli(
        capsys,
        *("--strategy", "ps", "--staleness", "0", "--servers", "2", "--devices", "2"),
        *MLP,
        *("--steps", "3", "--global-batch", "16", "--log-every", "1"),
        *("--max-grad-norm", "0.01", "--run-dir", str(run_dir)),
    )
    assert code == 0, err
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["grad_norm"] > 0.01 for r in records), records
