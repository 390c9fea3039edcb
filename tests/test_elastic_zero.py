"""zero2 under ``--elastic`` with shard copies: a death is survived from memory.

The pure tests cover the pieces (which slices are missing, the reassembly into canonical
tensors, the survivors named in the error that sends the run back to the checkpoint, the
refusals); two launches cover the path: one of 4 workers killed (3 go on with no
checkpoint read), and two ring neighbours killed together (a slice is lost: the run goes
back to the checkpoint, as without copies, and says so).
"""

from __future__ import annotations

import pytest
import torch

from paratrain.checkpoints.format import load_model_state
from paratrain.config import ConfigError, TrainConfig
from paratrain.parallel import strategy_class
from paratrain.parallel.zero.shard_copies import HeldShard
from paratrain.parallel.zero.shard_recovery import (
    canonical_from_slices,
    missing_slices,
    pick_slices,
)
from paratrain.run.elastic_checks import check_elastic
from paratrain.run.elastic_fallback import lost_state
from paratrain.runtime.elastic import ElasticStateLost
from paratrain.runtime.launch import WorkerError
from tests.test_elastic import TOLERANCE, records, train
from tests.test_parity_dp import relative_error

ZERO2 = ("--strategy", "zero2", "--devices", "4", "--elastic", "--min-devices", "2")


@pytest.fixture(scope="module")
def uninterrupted_zero2(tmp_path_factory) -> dict:
    """The same run on 4 zero2 workers, without copies and without a death."""
    run_dir = tmp_path_factory.mktemp("elastic_zero") / "whole"
    assert train(run_dir, "--strategy", "zero2", "--devices", "4") == 0
    return load_model_state(run_dir / "final")


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["forward", "optimizer"])
def test_a_kill_with_shard_copies_goes_on_at_three_without_the_checkpoint(
    tmp_path, monkeypatch, uninterrupted_zero2, capfd, phase
):
    """Worker 1 dies in step 5 (in its forward; or in its optimizer step, when the others
    have stepped their own slices and wait in the parameter all-gather, so they offer the
    slices they last sent): worker 0 holds its slice, so the 3 survivors put the state of
    step 4 together and redo step 5. No checkpoint is written or read
    (--checkpoint-every 0), and the weights are the uninterrupted run's to TOLERANCE
    (test_elastic's derivation: only the order of the per-sample sums differs)."""
    monkeypatch.setenv("PARATRAIN_FAULT", f"kill:1:5:{phase}")
    run_dir = tmp_path / "copies"
    assert train(run_dir, *ZERO2, "--shard-copies") == 0
    out = capfd.readouterr()
    assert "restart from" not in out.err
    assert "worker 1 lost in step 5; 3 of 4 workers go on (step 5 redone" in out.err + out.out
    assert not (run_dir / "checkpoints").exists()
    changes = records(run_dir, "workers")
    assert [(c["step"], c["old_workers"], c["new_workers"]) for c in changes] == [(5, 4, 3)]
    assert [(c["lost_ranks"], c["steps_redone"]) for c in changes] == [([1], 1)]
    assert [r["step"] for r in records(run_dir, "train")] == list(range(1, 7))
    error = relative_error(load_model_state(run_dir / "final"), uninterrupted_zero2)
    assert error <= TOLERANCE
    assert error > 0.0  # 3 shares instead of 4: the sums' order differs (not the same run)


@pytest.mark.slow
def test_two_ring_neighbours_lost_go_back_to_the_checkpoint(
    tmp_path, monkeypatch, uninterrupted_zero2, capfd
):
    """Workers 1 and 2 die together before step 5 (both right after step 4's last message;
    the launcher may see one death, post, then see the other, and the survivors then move
    to its second post, ``gather``): worker 1 held worker 2's only copy, so the 2
    survivors go back to step 4's checkpoint, saying so, and end as the whole run."""
    monkeypatch.setenv("PARATRAIN_FAULT", "kill:1:5:start,kill:2:5:start")
    run_dir = tmp_path / "neighbours"
    assert train(run_dir, *ZERO2, "--shard-copies", "--checkpoint-every", "2") == 0
    err = capfd.readouterr().err
    assert (
        "paratrain: worker 1, 2 lost; the survivors' shard copies do not cover every slice of "
        "zero2's state, so the 2 survivors restart from checkpoint "
        f"{run_dir / 'checkpoints' / 'step-00000004'} (step 4)."
    ) in err
    changes = records(run_dir, "workers")
    assert [(c["step"], c["old_workers"], c["new_workers"]) for c in changes] == [(5, 4, 2)]
    assert [(c["lost_ranks"], c["steps_redone"]) for c in changes] == [([1, 2], 1)]
    assert [r["step"] for r in records(run_dir, "train")] == list(range(1, 7))
    error = relative_error(load_model_state(run_dir / "final"), uninterrupted_zero2)
    assert error <= TOLERANCE


def held(version: int, values: list[float], step: float = 3.0) -> HeldShard:
    """One slice of a unit holding a 2x2 weight and a 2-vector (6 values, padded to 8 over
    2 ranks: 4 each), with an elementwise state and a step count."""
    param = torch.tensor(values, dtype=torch.float32)
    return HeldShard(
        version, [{"param": param, "state": {"exp_avg": param * 10, "step": torch.tensor(step)}}]
    )


def test_a_slice_held_by_nobody_at_the_step_is_missing():
    offered = [{0: [5, 4], 1: [4]}, {2: [5]}, {3: [4]}]  # rank 2 only one step ahead
    assert missing_slices(4, offered, 4) == [2]
    assert missing_slices(4, offered, 5) == [1, 3]
    assert missing_slices(3, [{0: [4], 1: [4]}, {2: [4]}], 4) == []


def test_slices_are_put_back_in_canonical_names():
    first, second = held(4, [1, 2, 3, 4]), held(4, [5, 6, 0, 0])
    picked = pick_slices([{0: [held(5, [9] * 4), first]}, {1: [second]}], 4)
    assert picked == {0: first, 1: second}
    model, optim = canonical_from_slices(
        picked, [(["w", "b"], [torch.Size([2, 2]), torch.Size([2])])]
    )
    assert torch.equal(model["w"], torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert torch.equal(model["b"], torch.tensor([5.0, 6.0]))  # the padding left out
    assert torch.equal(optim["b/exp_avg"], torch.tensor([50.0, 60.0]))
    assert optim["w/step"].item() == optim["b/step"].item() == 3.0


def test_the_survivors_name_themselves_for_the_checkpoint_fallback():
    lost = ElasticStateLost("no survivor holds the optimizer slice of replica(s) 2", (0, 3))
    assert str(lost).endswith(
        "the 2 survivors (launch ranks 0, 3) go back to the newest checkpoint."
    )
    details = f"Traceback (most recent call last):\n...\nElasticStateLost: {lost}\n"
    assert lost_state(WorkerError(0, details, failures={0: details})) == [0, 3]
    other = "RuntimeError: injected crash at step 4 (backward)"
    assert lost_state(WorkerError(1, other)) is None


def test_shard_copies_refuse_replacements_and_split_layers():
    base = {"model": "mlp", "dataset": "synthetic", "strategy": "zero2", "elastic": True}
    copies = TrainConfig(**base, shard_copies=True, max_restarts=1, global_batch=24)
    with pytest.raises(ConfigError, match="cannot yet hand its sharded state to; drop"):
        check_elastic(copies, 4)
    check_elastic(TrainConfig(**base, max_restarts=1, global_batch=24), 4)  # the fallback
    check_elastic(TrainConfig(**base, shard_copies=True, global_batch=24, min_devices=2), 4)


def test_the_copies_are_counted_in_the_memory_a_worker_needs():
    """Adam: zero2 holds 4 + (4 + 8) / 4 bytes per parameter on 4 workers; the copy and the
    kept send buffer add two slices of weights and optimizer state, 2 * (4 + 8) / 4."""
    zero2 = strategy_class("zero2")
    assert zero2.model_state_per_worker(100, 4, {}) == (4 + 12 / 4) * 100
    assert zero2.model_state_per_worker(100, 4, {"shard_copies": True}) == (4 + 36 / 4) * 100
    assert zero2.model_state_per_worker(100, 1, {"shard_copies": True}) == 16 * 100  # no ring
