"""Known ways DP-SGD users lose their guarantee, refused before the first step: a loader
that does not sample with sailfin's sampler, and a model Opacus cannot train privately."""

import pytest
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, WeightedRandomSampler

from sailfin import Trainer, TrainerArguments
from sailfin.config.errors import ConfigError
from tests.dp.recipes import dp_args
from tests.recipes import IdData, LinearRecipe

pytest.importorskip("opacus")


class Weighted(LinearRecipe):
    def get_train_dataloader(self, sampler, batch_size):
        ds = self.data.get_train_dataset()
        sampler(ds)  # asked for, then not used
        return DataLoader(ds, batch_size=batch_size,
                          sampler=WeightedRandomSampler(torch.ones(len(ds)), len(ds)))


class FixedBatches(LinearRecipe):
    def get_train_dataloader(self, sampler, batch_size):
        ds = self.data.get_train_dataset()
        sampler(ds)
        return DataLoader(ds, batch_sampler=BatchSampler(SequentialSampler(ds), batch_size,
                                                         drop_last=False))


class DropLast(LinearRecipe):
    def get_train_dataloader(self, sampler, batch_size):
        ds = self.data.get_train_dataset()
        return DataLoader(ds, batch_size=batch_size, sampler=sampler(ds), drop_last=True)


class NotALoader(LinearRecipe):
    def get_train_dataloader(self, sampler, batch_size):
        ds = self.data.get_train_dataset()
        loader = DataLoader(ds, batch_size=batch_size, sampler=sampler(ds))
        return (batch for batch in loader)


@pytest.mark.parametrize("recipe, says", [
    (Weighted, "returned a DataLoader that samples with its own sampler "
               "(WeightedRandomSampler)"),
    (FixedBatches, "returned a DataLoader that samples with its own batch sampler "
                   "(BatchSampler)"),
    (DropLast, "returned a DataLoader that drops the last micro-batch (drop_last=True)"),
    (NotALoader, "returned a generator that is not a torch DataLoader"),
])
@pytest.mark.parametrize("poisson", [True, False])
def test_a_loader_that_does_not_sample_with_sailfins_sampler_is_refused(
        tmp_path, recipe, says, poisson):
    module = recipe(IdData(47, 0))
    args = dp_args(tmp_path, dp={"noise_multiplier": 1.0, "poisson_sampling": poisson})
    with pytest.raises(ValueError) as info:
        Trainer(module, args).train()
    line = str(info.value)
    assert says in line and "under a -dp backend" in line and "\n" not in line
    assert "sampler=sampler(dataset)" in line  # the way out
    assert module.seen == []


def test_the_same_loaders_train_without_dp(tmp_path):
    """What is refused is refused for privacy: without dp the weighted loader trains."""
    module = Weighted(IdData(47, 0))
    Trainer(module, TrainerArguments(backend="sp", epochs=1, train_batch_size=10,
                                     micro_batch_size=5, output_dir=str(tmp_path),
                                     writers=[], progress="none")).train()
    assert module.seen


class WithLSTM(LinearRecipe):
    def __init__(self, data):
        super().__init__(data)
        self.rnn = nn.LSTM(4, 4, batch_first=True)

    def forward(self, x):
        return self.linear(self.rnn(x[:, None, :])[0][:, 0]).squeeze(-1)


def test_a_layer_opacus_fixes_is_named_with_the_way_out_and_fix_model_trains(tmp_path):
    module = WithLSTM(IdData(47, 0))
    with pytest.raises(ConfigError) as info:
        Trainer(module, dp_args(tmp_path / "refused")).train()
    line = str(info.value)
    assert "rnn (LSTM)" in line and "trainer.dp.fix_model: true" in line and "replace rnn" in line
    fixed = WithLSTM(IdData(47, 0))
    summary = Trainer(fixed, dp_args(tmp_path / "fixed", dp={"noise_multiplier": 1.0,
                                                             "fix_model": True})).train()
    assert type(fixed.rnn).__name__ == "DPLSTM" and fixed.seen
    assert summary["privacy"]["epsilon"] > 0


class Unfixable(LinearRecipe):
    """A trainable layer holding a buffer: Opacus has no fixer for it."""

    def __init__(self, data):
        super().__init__(data)
        self.linear.register_buffer("scale", torch.ones(1))


def test_a_layer_opacus_cannot_fix_gets_no_advice_that_would_not_work(tmp_path):
    with pytest.raises(ConfigError) as info:
        Trainer(Unfixable(IdData(47, 0)), dp_args(tmp_path)).train()
    line = str(info.value)
    assert "linear (Linear, trainable with buffers)" in line
    assert "fix_model" not in line
