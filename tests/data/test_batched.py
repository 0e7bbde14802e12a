"""Batched fetching: gathered micro-batches equal the standard DataLoader's, bit for bit,
and every case that could differ keeps the recipe's loader."""

import pytest
import torch
from torch.utils.data import DataLoader, Subset, TensorDataset, random_split

from sailfin import DataInterface, Trainer
from sailfin.data import BatchPlan, ResumableSampler
from sailfin.data.batched import GatheredTensors, can_gather, gathered_loader
from tests.recipes import LinearRecipe, args


def tensors(n=23):
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(n, 3, 2, generator=g),           # float32, 3-d
                         torch.randint(0, 9, (n,), generator=g),       # int64, 1-d
                         torch.rand(n, generator=g) > 0.5,             # bool
                         torch.randint(0, 255, (n, 4), dtype=torch.uint8, generator=g),
                         torch.randn(n, 2, dtype=torch.float64, generator=g))


def batches(loader):
    return list(loader)


def assert_identical(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert x.dtype == y.dtype and x.shape == y.shape and x.is_contiguous()
            assert torch.equal(x, y)


def sampler_for(n, world=1, rank=0, global_batch=8, micro=4, seed=5):
    return ResumableSampler(n, BatchPlan.create(global_batch, micro, world), rank, seed)


@pytest.mark.parametrize("dataset", [
    tensors(),
    random_split(tensors(), [15, 8], generator=torch.Generator().manual_seed(0))[0],
    Subset(Subset(tensors(), list(range(20, 1, -1))), [0, 5, 2, 7, 3, 9, 11, 1, 4, 6, 8]),
    TensorDataset(torch.arange(23.0)),                                 # one tensor
], ids=["tensors", "random_split", "nested_subset", "one_tensor"])
def test_gathered_batches_are_identical(dataset):
    sampler = sampler_for(len(dataset))  # a short last micro-batch in each epoch
    standard = DataLoader(dataset, batch_size=4, sampler=sampler)
    gathered = gathered_loader(standard, sampler)
    assert isinstance(gathered.dataset, GatheredTensors) and gathered.dataset.source is dataset
    for epoch, start in ((0, 0), (1, 0), (2, 1)):  # another order, and a resumed epoch
        sampler.set_epoch(epoch, start)
        assert_identical(batches(gathered), batches(standard))


def test_padding_micro_batches_are_identical():
    """world 2, 21 samples, global 8: the last step (5 samples) gives rank 1 a share of 2
    = one full micro-batch of 2, then the weight-0 padding sample (the step's first)."""
    ds = tensors(21)
    plan = BatchPlan.create(8, 2, 2)
    assert plan.micro_batches(2, 21, 1)[-1].padding
    sampler = ResumableSampler(21, plan, rank=1, seed=1)
    standard = DataLoader(ds, batch_size=2, sampler=sampler)
    got = batches(gathered_loader(standard, sampler))
    assert_identical(got, batches(standard))
    assert len(got[-1][0]) == 1  # the padding micro-batch is one sample


def test_gathered_with_workers_and_pinning():
    ds = tensors(40)
    sampler = sampler_for(40)
    standard = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2,
                          generator=torch.Generator().manual_seed(0))
    gathered = gathered_loader(standard, sampler)
    assert gathered.num_workers == 2 and gathered.generator is standard.generator
    assert_identical(batches(gathered), batches(standard))


def test_loader_settings_are_carried():
    ds = tensors()
    sampler = sampler_for(len(ds))
    init = lambda worker_id: None  # noqa: E731
    standard = DataLoader(ds, batch_size=4, sampler=sampler, pin_memory=False, timeout=0,
                          worker_init_fn=init)
    gathered = gathered_loader(standard, sampler)
    assert gathered.sampler is sampler and gathered.batch_size == 4
    assert gathered.worker_init_fn is init and gathered.drop_last is False


class Augmented(TensorDataset):
    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return x + 1, y


class EpochTensors(TensorDataset):
    pass


class MyLoader(DataLoader):
    pass


def with_set_epoch():
    ds = tensors()
    ds.set_epoch = lambda epoch: None
    return ds


@pytest.mark.parametrize("build", [
    lambda ds, s: DataLoader(ds, batch_size=4, sampler=s, collate_fn=lambda b: b),  # custom
    lambda ds, s: DataLoader(Augmented(*ds.tensors), batch_size=4, sampler=s),  # subclass
    lambda ds, s: DataLoader(with_set_epoch(), batch_size=4, sampler=s),  # per-epoch work
    lambda ds, s: DataLoader(Subset(with_set_epoch(), range(23)), batch_size=4, sampler=s),
    lambda ds, s: MyLoader(ds, batch_size=4, sampler=s),  # a DataLoader subclass
    lambda ds, s: DataLoader(ds, batch_size=4, sampler=sampler_for(23)),  # not this sampler
    lambda ds, s: DataLoader(ds, batch_sampler=torch.utils.data.BatchSampler(s, 4, False)),
], ids=["collate_fn", "subclass", "set_epoch", "subset_set_epoch", "loader_subclass",
        "other_sampler", "batch_sampler"])
def test_fallbacks_keep_the_recipes_loader(build):
    ds = tensors()
    sampler = sampler_for(23)
    loader = build(ds, sampler)
    assert not can_gather(loader, sampler)
    assert gathered_loader(loader, sampler) is loader


class CountingGetitems(torch.utils.data.Dataset):
    """A dataset with its own batched read: the standard DataLoader calls it per batch."""

    def __init__(self, n):
        self.n, self.calls = n, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        raise AssertionError("fetched one sample at a time")

    def __getitems__(self, indices):
        self.calls.append(list(indices))
        return [(i, float(i)) for i in indices]


def test_a_datasets_own_getitems_gets_the_plans_micro_batches():
    ds = CountingGetitems(10)
    sampler = sampler_for(10)
    loader = gathered_loader(DataLoader(ds, batch_size=4, sampler=sampler), sampler)
    out = batches(loader)
    order = sampler.epoch_order().tolist()
    assert ds.calls == [order[0:4], order[4:8], order[8:10]]
    assert [b[0].tolist() for b in out] == ds.calls


class TensorIdData(DataInterface):
    """The tests' IdDataset as a TensorDataset (ids, x, y)."""

    def __init__(self, n):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(n, 4, generator=g)
        y = x @ torch.arange(1, 5, dtype=torch.float32) + 0.1 * torch.randn(n, generator=g)
        self.train = TensorDataset(torch.arange(n), x, y)

    def get_train_dataset(self):
        return self.train


def test_trainer_results_are_bit_identical(tmp_path, monkeypatch):
    def run(out):
        module = LinearRecipe(TensorIdData(45), momentum=0.9)
        trainer = Trainer(module, args(out, epochs=2, train_batch_size=12, micro_batch_size=4))
        trainer.train()
        return trainer, module

    gathered, module = run(tmp_path / "gathered")
    assert isinstance(gathered.train_loader.dataset, GatheredTensors)
    monkeypatch.setattr("sailfin.trainer.core.loaders.gathered_loader", lambda loader, s: loader)
    standard, ref = run(tmp_path / "standard")
    assert isinstance(standard.train_loader.dataset, TensorDataset)
    assert module.seen == ref.seen and module.step_ids == ref.step_ids
    for (k, v), w in zip(module.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(v, w), k
