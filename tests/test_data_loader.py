"""Global and sharded batch loaders: the data-parallel batch contract, tails, resume."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from paratrain.data import GlobalBatchLoader, ShardedBatchLoader, batches

N = 103


def numbered(n: int = N) -> TensorDataset:
    """Sample i is (i as a 2-feature row, 10*i): the values name the sample."""
    index = torch.arange(n)
    return TensorDataset(torch.stack([index, -index], dim=1).float(), index * 10)


def ids(batch) -> list[int]:
    """Sample ids of a batch, after checking its two fields stayed aligned."""
    inputs, targets = batch
    assert torch.equal(inputs[:, 0].long() * 10, targets)
    assert torch.equal(inputs[:, 1], -inputs[:, 0])
    return inputs[:, 0].long().tolist()


def epoch_ids(loader) -> list[list[int]]:
    return [ids(batch) for batch in loader]


def test_ranks_with_the_same_seed_see_identical_global_batches() -> None:
    rank0 = GlobalBatchLoader(numbered(), 10, seed=7)
    rank1 = GlobalBatchLoader(numbered(), 10, seed=7)
    for _ in range(3):
        assert epoch_ids(rank0) == epoch_ids(rank1)
    assert rank0.epoch == rank1.epoch == 2
    other = GlobalBatchLoader(numbered(), 10, seed=8)
    assert epoch_ids(other) != epoch_ids(GlobalBatchLoader(numbered(), 10, seed=7))


def test_epoch_order_is_the_documented_permutation() -> None:
    loader = GlobalBatchLoader(numbered(), 10, seed=5)
    for epoch in range(2):
        perm = torch.randperm(N, generator=torch.Generator().manual_seed(5 + epoch)).tolist()
        got = epoch_ids(loader)
        assert loader.epoch == epoch
        assert got == [perm[i * 10 : (i + 1) * 10] for i in range(10)]


def test_each_iter_reshuffles() -> None:
    loader = GlobalBatchLoader(numbered(), 10)
    first, second = epoch_ids(loader), epoch_ids(loader)
    assert loader.epoch == 1
    assert first != second
    for epoch in (first, second):
        assert len(set(sum(epoch, []))) == 100  # no repeats within an epoch


def test_no_shuffle_is_in_order() -> None:
    loader = GlobalBatchLoader(numbered(), 25, shuffle=False)
    assert epoch_ids(loader) == [list(range(i, i + 25)) for i in range(0, 100, 25)]
    assert epoch_ids(loader) == [list(range(i, i + 25)) for i in range(0, 100, 25)]


def test_tail_drop_counts_and_contents() -> None:
    loader = GlobalBatchLoader(numbered(), 10, tail="drop", seed=1)
    assert len(loader) == 10
    got = epoch_ids(loader)
    assert len(got) == 10 and all(len(b) == 10 for b in got)
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(1)).tolist()
    assert set(sum(got, [])) == set(perm[:100])  # the last 3 of the order are dropped


def test_tail_wrap_counts_and_contents() -> None:
    loader = GlobalBatchLoader(numbered(), 10, tail="wrap", seed=1)
    assert len(loader) == 11
    got = epoch_ids(loader)
    assert len(got) == 11 and all(len(b) == 10 for b in got)
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(1)).tolist()
    assert got[-1] == perm[100:103] + perm[0:7]
    assert set(sum(got, [])) == set(range(N))  # every sample seen this epoch


def test_tail_wrap_on_a_dataset_smaller_than_one_batch() -> None:
    loader = GlobalBatchLoader(numbered(3), 8, tail="wrap", shuffle=False)
    assert epoch_ids(loader) == [[0, 1, 2, 0, 1, 2, 0, 1]]


def test_tail_drop_on_a_dataset_smaller_than_one_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="3 samples, fewer than one global batch of 8") as info:
        GlobalBatchLoader(numbered(3), 8)
    assert "tail='wrap'" in str(info.value)


@pytest.mark.parametrize("tail", ["drop", "wrap"])
@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_shares_concatenate_to_the_global_batch(tail: str, replicas: int) -> None:
    reference = GlobalBatchLoader(numbered(), 12, seed=3, tail=tail)
    shards = [
        ShardedBatchLoader(numbered(), 12, rank=r, replicas=replicas, seed=3, tail=tail)
        for r in range(replicas)
    ]
    assert {len(s) for s in shards} == {len(reference)}  # equal counts: nobody waits
    for _ in range(2):
        global_batches = list(reference)
        per_rank = [list(s) for s in shards]
        assert all(len(p) == len(global_batches) for p in per_rank)
        for i, (inputs, targets) in enumerate(global_batches):
            share = 12 // replicas
            for r in range(replicas):
                shard_inputs, shard_targets = per_rank[r][i]
                # exactly the rows an engine slices from the global batch
                assert torch.equal(shard_inputs, inputs[r * share : (r + 1) * share])
                assert torch.equal(shard_targets, targets[r * share : (r + 1) * share])
            assert torch.equal(torch.cat([per_rank[r][i][0] for r in range(replicas)]), inputs)
    assert shards[-1].share == 12 // replicas


def test_sharded_loader_reads_only_its_share() -> None:
    class Counting(Dataset):
        def __init__(self) -> None:
            self.read: list[int] = []

        def __len__(self) -> int:
            return 40

        def __getitem__(self, i: int):
            self.read.append(i)
            return torch.tensor([float(i)]), i

    data = Counting()
    loader = ShardedBatchLoader(data, 8, rank=1, replicas=4, seed=0)
    got = list(loader)
    assert len(got) == 5 and all(b[0].shape == (2, 1) for b in got)
    assert len(data.read) == 10  # 5 batches x share of 2, not 5 x 8
    assert [b[1].tolist() for b in got] == [
        loader.global_indices(0, i)[2:4].tolist() for i in range(5)
    ]


def test_generic_dataset_matches_tensor_fast_path() -> None:
    class Items(Dataset):
        def __len__(self) -> int:
            return N

        def __getitem__(self, i: int):
            return torch.tensor([float(i), float(-i)]), i * 10

    slow = GlobalBatchLoader(Items(), 10, seed=4)
    fast = GlobalBatchLoader(numbered(), 10, seed=4)
    for (xs, ys), (xf, yf) in zip(slow, fast, strict=True):
        assert torch.equal(xs, xf) and torch.equal(ys, yf)


def test_uneven_split_and_bad_rank_are_refused() -> None:
    with pytest.raises(ValueError, match="global_batch 10 does not split evenly over 4") as info:
        ShardedBatchLoader(numbered(), 10, rank=0, replicas=4)
    assert "multiple of 4, e.g. 8 or 12" in str(info.value)
    with pytest.raises(ValueError, match="e.g. 4") as info:
        ShardedBatchLoader(numbered(), 3, rank=0, replicas=4)
    with pytest.raises(ValueError, match=r"rank 4 is outside 0\.\.3 for 4 replicas"):
        ShardedBatchLoader(numbered(), 8, rank=4, replicas=4)
    with pytest.raises(ValueError, match="rank -1"):
        ShardedBatchLoader(numbered(), 8, rank=-1, replicas=4)
    with pytest.raises(ValueError, match="replicas must be a positive integer"):
        ShardedBatchLoader(numbered(), 8, rank=0, replicas=0)
    with pytest.raises(ValueError, match="global_batch must be a positive integer"):
        GlobalBatchLoader(numbered(), 0)
    with pytest.raises(ValueError, match="tail must be 'drop' or 'wrap'"):
        GlobalBatchLoader(numbered(), 4, tail="pad")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty"):
        GlobalBatchLoader(numbered(0), 4, tail="wrap")


def test_batches_crosses_epochs_and_continues() -> None:
    reference = GlobalBatchLoader(numbered(), 10, seed=2)
    epochs = [epoch_ids(reference) for _ in range(3)]
    loader = GlobalBatchLoader(numbered(), 10, seed=2)
    got = [ids(b) for b in batches(loader, 25)]
    assert got == epochs[0] + epochs[1] + epochs[2][:5]
    assert loader.epoch == 2 and loader.position == 5
    # a second call finishes the epoch left part-way before starting the next
    more = [ids(b) for b in batches(loader, 7)]
    assert more == epochs[2][5:] + [ids(b) for b in list(reference)[:2]]
    assert list(batches(loader, 0)) == []
    with pytest.raises(ValueError, match="steps must be a non-negative integer"):
        batches(loader, -1)


def test_batches_over_a_plain_iterable() -> None:
    assert list(batches([1, 2, 3], 7)) == [1, 2, 3, 1, 2, 3, 1]
    with pytest.raises(ValueError, match="no batch in a whole pass"):
        list(batches([], 2))


@pytest.mark.parametrize("sharded", [False, True])
def test_state_dict_resumes_mid_epoch(sharded: bool) -> None:
    def build():
        if sharded:
            return ShardedBatchLoader(numbered(), 12, rank=1, replicas=3, seed=9, tail="wrap")
        return GlobalBatchLoader(numbered(), 12, seed=9, tail="wrap")

    reference = build()
    epochs = [epoch_ids(reference) for _ in range(3)]

    running = build()
    list(running)  # epoch 0
    seen = []
    for batch in running:  # epoch 1, interrupted after 4 batches
        seen.append(ids(batch))
        if len(seen) == 4:
            break
    state = running.state_dict()
    assert state["epoch"] == 1 and state["position"] == 4

    restored = build()
    restored.load_state_dict(state)
    rest = epoch_ids(restored)
    assert seen + rest == epochs[1]
    assert restored.epoch == 1
    assert epoch_ids(restored) == epochs[2]  # and then the next epoch as usual


def test_state_after_a_full_epoch_points_at_the_next() -> None:
    loader = GlobalBatchLoader(numbered(), 10)
    assert loader.state_dict()["epoch"] == 0 and loader.state_dict()["position"] == 0
    list(loader)
    assert (loader.state_dict()["epoch"], loader.state_dict()["position"]) == (1, 0)
    restored = GlobalBatchLoader(numbered(), 10)
    restored.load_state_dict({"epoch": 0, "position": 10})
    assert epoch_ids(restored) == epoch_ids(GlobalBatchLoader(numbered(), 10, seed=1))
    assert restored.epoch == 1


def test_state_is_rank_independent_and_moves_across_replica_counts() -> None:
    states = []
    for rank in range(2):
        loader = ShardedBatchLoader(numbered(), 8, rank=rank, replicas=2, seed=4)
        for _ in batches(loader, 15):
            pass
        states.append(loader.state_dict())
    assert states[0] == states[1]
    reference = GlobalBatchLoader(numbered(), 8, seed=4)
    reference.load_state_dict(states[0])
    expected = list(reference)
    four = [ShardedBatchLoader(numbered(), 8, rank=r, replicas=4, seed=4) for r in range(4)]
    for loader in four:
        loader.load_state_dict(states[0])
    shares = [list(loader) for loader in four]
    assert len(expected) == 9  # 12 batches per epoch, 15 taken: epoch 1 at position 3
    for i, (inputs, _) in enumerate(expected):
        assert torch.equal(torch.cat([shares[r][i][0] for r in range(4)]), inputs)


def test_load_state_dict_refuses_other_settings() -> None:
    state = GlobalBatchLoader(numbered(), 10, seed=1).state_dict()
    with pytest.raises(ValueError, match="global_batch=10 but this loader has global_batch=20"):
        GlobalBatchLoader(numbered(), 20, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=1"):
        GlobalBatchLoader(numbered(), 10, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="position=11 is impossible for 10 batches"):
        GlobalBatchLoader(numbered(), 10).load_state_dict({"epoch": 0, "position": 11})


def test_a_stale_iterator_does_not_move_the_cursor() -> None:
    loader = GlobalBatchLoader(numbered(), 10)
    old = iter(loader)
    next(old)
    loader.load_state_dict({"epoch": 5, "position": 3})
    next(old)
    assert (loader.epoch, loader.position) == (5, 3)
