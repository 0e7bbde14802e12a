"""Random augmentation inside DataLoader workers: exact on resume when seeded per sample."""

import numpy as np
import pytest
import torch

from sailfin import DataInterface, Trainer
from sailfin.data import sample_seed
from tests.checkpoint.helpers import Crash, CrashAt, assert_same_params, params
from tests.recipes import IdDataset, LinearRecipe, args

CKPT = {"every_n_steps": 3, "at_epoch_end": True}


class Augmented(IdDataset):
    """IdDataset with noise added to each input: drawn from (seed, epoch, index), or, as
    the control, from the loading worker's own random stream."""

    def __init__(self, n: int, per_sample: bool) -> None:
        super().__init__(n, seed=1)
        self.per_sample = per_sample
        self.epoch = 0
        self.epochs_set: list[int] = []  # calls seen by the main process's copy

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.epochs_set.append(epoch)

    def __getitem__(self, i):
        i, x, y = super().__getitem__(i)
        if self.per_sample:
            g = torch.Generator().manual_seed(sample_seed(0, self.epoch, i))
            noise = torch.randn(x.shape, generator=g)
        else:
            noise = torch.randn(x.shape)  # the worker's stream starts afresh on resume
        return i, x + 0.5 * noise, y


class AugData(DataInterface):
    def __init__(self, per_sample: bool) -> None:
        self.train = Augmented(47, per_sample)

    def get_train_dataset(self):
        return self.train

    def get_val_dataset(self):
        return None


class TwoWorkers(LinearRecipe):
    def get_train_dataloader(self, sampler, batch_size):
        ds = self.data.get_train_dataset()
        return torch.utils.data.DataLoader(ds, batch_size=batch_size, sampler=sampler(ds),
                                           num_workers=2)


def run(tmp, per_sample: bool, crash_at=None):
    module = TwoWorkers(AugData(per_sample), momentum=0.9)
    callbacks = [CrashAt(crash_at)] if crash_at else []
    trainer = Trainer(module, args(tmp, epochs=3, checkpoint=CKPT), callbacks=callbacks)
    try:
        trainer.train()
    except Crash:
        pass
    return module


def interrupted(tmp, per_sample: bool):
    for crash in (4, 8):  # resumes from step 3 (mid-epoch 0) and step 6 (mid-epoch 1)
        run(tmp, per_sample, crash)
    return run(tmp, per_sample)


def test_augmentation_seeded_per_sample_resumes_bit_identical(tmp_path):
    ref = run(tmp_path / "ref", per_sample=True)
    assert ref.data.train.epochs_set == [0, 1, 2]
    module = interrupted(tmp_path / "run", per_sample=True)
    assert module.data.train.epochs_set == [1, 2]  # the resumed epoch is set again
    assert_same_params(params(ref), params(module))


def test_control_augmentation_from_the_worker_stream_is_not_exact_on_resume(tmp_path):
    """The same run with the noise drawn from each worker's stream: the test above would
    notice a resume that is not exact."""
    ref = run(tmp_path / "ref", per_sample=False)
    again = run(tmp_path / "again", per_sample=False)
    assert_same_params(params(ref), params(again))  # deterministic when uninterrupted
    module = interrupted(tmp_path / "run", per_sample=False)
    assert any(not torch.equal(a, b) for a, b in zip(params(ref).values(),
                                                     params(module).values()))


def test_sample_seed_depends_on_each_part():
    base = sample_seed(0, 1, 2)
    assert base == sample_seed(0, 1, 2) and 0 <= base < 2**64
    assert len({base, sample_seed(1, 1, 2), sample_seed(0, 2, 2), sample_seed(0, 1, 3)}) == 4
    np.random.default_rng(base)  # usable as a NumPy seed as well
    torch.Generator().manual_seed(base)


def test_persistent_workers_with_set_epoch_warn(tmp_path):
    class Persistent(LinearRecipe):
        def get_train_dataloader(self, sampler, batch_size):
            ds = self.data.get_train_dataset()
            return torch.utils.data.DataLoader(ds, batch_size=batch_size, sampler=sampler(ds),
                                               num_workers=1, persistent_workers=True)

    trainer = Trainer(Persistent(AugData(True)), args(tmp_path))
    with pytest.warns(RuntimeWarning, match="persistent_workers=False"):
        trainer.setup()
