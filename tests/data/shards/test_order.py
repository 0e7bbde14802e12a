"""The epoch order over shards: exactly once, world-size independent, resumable."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sailfin.data import BatchPlan, ResumableSampler, ShardDataset
from sailfin.data.shards import window_order

from .helpers import SIZES, write_shards

GLOBAL = 12
SEED = 7


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    write_shards(root)
    return root


def dataset(root, **kw) -> ShardDataset:
    return ShardDataset(str(root / "shard-{000000..000005}.tar"), fields=("cls",), **kw)


def rank_batches(ds, world, rank, workers, epoch, start_step=0, micro=3):
    """The id batches rank ``rank`` of ``world`` loads, built as the trainer builds them."""
    plan = BatchPlan.create(GLOBAL, micro, world)
    sampler = ResumableSampler(len(ds), plan, rank, SEED, order=ds.epoch_order)
    sampler.set_epoch(epoch, start_step)
    loader = torch.utils.data.DataLoader(ds, batch_size=plan.micro_batch, sampler=sampler,
                                         num_workers=workers)
    return plan, [batch[0].tolist() for batch in loader]


def global_sequence(ds, world, workers, epoch, start_step=0, micro=3):
    """Every rank's batches put back into step order: step k = rank 0's share, rank 1's..."""
    per_rank = []
    for rank in range(world):
        plan, batches = rank_batches(ds, world, rank, workers, epoch, start_step, micro)
        steps, pos = [], 0
        for step in range(start_step, plan.steps_in_epoch(len(ds))):
            micros = plan.micro_batches(step, len(ds), rank)
            got = batches[pos:pos + len(micros)]
            assert [len(b) for b in got] == [m.count for m in micros], \
                "a micro-batch differs from the plan"
            steps.append(sum((b for b, m in zip(got, micros) if not m.padding), []))
            pos += len(micros)
        assert pos == len(batches)  # every rank ran exactly the planned micro-batches
        per_rank.append(steps)
    return [i for step in zip(*per_rank) for share in step for i in share]


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("workers", [0, 2])
def test_exactly_once_per_epoch_in_the_dataset_order(shards, world, workers):
    ds = dataset(shards)
    for epoch in (0, 1):
        seq = global_sequence(ds, world, workers, epoch)
        assert sorted(seq) == list(range(sum(SIZES)))              # each sample once
        assert seq == ds.epoch_order(SEED, epoch).tolist()          # in the dataset's order
    assert ds.epoch_order(SEED, 0).tolist() != ds.epoch_order(SEED, 1).tolist()


def test_same_order_for_the_same_seed_whatever_the_world_size(shards):
    ds = dataset(shards)
    one = global_sequence(ds, world=1, workers=0, epoch=3, micro=6)
    two = global_sequence(ds, world=2, workers=0, epoch=3, micro=2)
    three = global_sequence(ds, world=3, workers=0, epoch=3, micro=4)
    assert one == two == three
    # A fresh dataset object (another process) computes the same order.
    assert dataset(shards).epoch_order(SEED, 3).tolist() == one


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)])
def test_resume_mid_epoch_on_another_world_size_continues_the_order(shards, before, after):
    ds = dataset(shards)
    stop = 2  # steps done before the "crash": the checkpoint holds (epoch, 2, seed)
    done = []
    for rank in range(before):
        plan, batches = rank_batches(ds, before, rank, workers=0, epoch=1)
        per_step = len(plan.micro_batches(0, len(ds), rank))
        done.append(batches[:stop * per_step])
    # Put the first `stop` steps back in order: each step is rank 0's share then rank 1's.
    first = []
    for step in range(stop):
        for rank in range(before):
            per_step = len(done[rank]) // stop
            first += sum(done[rank][step * per_step:(step + 1) * per_step], [])
    rest = global_sequence(ds, after, workers=2 if after == 2 else 0, epoch=1, start_step=stop)
    assert first + rest == ds.epoch_order(SEED, 1).tolist()
    assert len(first) == stop * GLOBAL


def test_windows_bound_the_shards_a_step_reads(shards):
    ds = dataset(shards, shuffle_window=2)
    order = ds.epoch_order(SEED, 0)
    shard_of = np.searchsorted(np.cumsum(SIZES), order, side="right")
    for step in range(0, len(order), GLOBAL):
        assert len(set(shard_of[step:step + GLOBAL].tolist())) <= 4  # two windows of 2


def test_window_order_is_a_pure_permutation():
    counts = [5, 0, 3, 8, 1]
    a = window_order(counts, seed=1, epoch=2, window=2)
    assert sorted(a.tolist()) == list(range(17))
    assert a.tolist() == window_order(counts, seed=1, epoch=2, window=2).tolist()
    assert a.tolist() != window_order(counts, seed=2, epoch=2, window=2).tolist()
    assert window_order(counts, 1, 2, 2, shuffle=False).tolist() == list(range(17))
    # window=1: samples never leave their shard's run of positions
    one = window_order(counts, seed=1, epoch=0, window=1)
    runs = np.searchsorted(np.cumsum(counts), one, side="right")
    assert sum(1 for x, y in zip(runs, runs[1:]) if x != y) == 3  # 4 non-empty shards


def test_a_shard_dataset_is_an_ordered_dataset(shards):
    from sailfin.data.sampler import OrderedDataset

    assert isinstance(dataset(shards), OrderedDataset)
    assert not isinstance(torch.utils.data.TensorDataset(torch.zeros(3)), OrderedDataset)


def test_trainer_shuffle_false_gives_the_natural_order(shards):
    ds = dataset(shards)
    plan = BatchPlan.create(GLOBAL, 3, 1)
    sampler = ResumableSampler(len(ds), plan, 0, SEED, shuffle=False, order=ds.epoch_order)
    assert list(sampler) == list(range(len(ds)))
    assert dataset(shards, shuffle=False).epoch_order(SEED, 4).tolist() == list(range(len(ds)))
