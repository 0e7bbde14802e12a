"""PyMarlin's recipe forms run unchanged, and exactly (#28): a 0-d val_step value is the
batch mean counted once per sample, train_step's (loss, outputs...) reach
on_end_train_step, older callback signatures get what they take, tuple val_step outputs
reach on_end_val_epoch(global_step, *inputs, key=...), and a DataProcessor that skips
super().__init__() runs in a process pool."""

import pytest
import torch
from torch import nn

from sailfin import DataProcessor, Trainer
from sailfin.trainer.safety.startup_checks import StartupCheckError
from tests.recipes import IdData, LinearRecipe, args


class PerSampleVal(LinearRecipe):
    def val_step(self, global_step, batch, device):
        ids, x, y = batch
        return {"loss": (self(x) - y) ** 2}

    def on_end_val_epoch(self, global_step, outputs, key="val"):
        return {"loss": outputs["loss"].mean()}


class MeanVal(PerSampleVal):
    def val_step(self, global_step, batch, device):  # PyMarlin's text recipes: a batch mean
        ids, x, y = batch
        return {"loss": ((self(x) - y) ** 2).mean()}


class PyMarlinRecipe(LinearRecipe):
    """PyMarlin's signatures: (loss, preds) from train_step, a tuple from val_step with
    a 0-d loss, on_end_train_step(global_step, loss, preds), on_end_val_epoch(*inputs)."""

    def train_step(self, global_step, batch, device):
        ids, x, y = batch
        pred = self(x)
        return nn.functional.mse_loss(pred, y), pred.detach(), y

    def val_step(self, global_step, batch, device):
        ids, x, y = batch
        pred = self(x)
        return ((pred - y) ** 2).mean(), pred, y

    def on_end_train_step(self, global_step, loss, preds, labels):
        self.events.append(("end_step", global_step, tuple(preds.shape), tuple(labels.shape)))

    def on_end_val_epoch(self, global_step, *inputs, key="default"):
        losses, preds, labels = inputs
        self.events.append(("val", key, len(losses), len(preds)))
        return {"loss": losses.mean(), "mse": ((preds - labels) ** 2).mean()}


class NamedColumns(PyMarlinRecipe):
    """PyMarlin's covid19 example names its columns instead of taking ``*inputs``."""

    def on_end_val_epoch(self, global_step, losses, logits, labels, key="default"):
        self.events.append(("val", global_step, key, len(losses), len(logits)))
        return {"loss": losses.mean(), "mse": ((logits - labels) ** 2).mean()}


class TooFewColumns(PyMarlinRecipe):
    def on_end_val_epoch(self, global_step, losses, logits, key="default"):  # 3 columns come
        self.events.append(("val", global_step))


class OldSignature(LinearRecipe):
    def on_end_train_step(self, global_step, loss):  # PyMarlin's older two-argument form
        self.events.append(("end_step", global_step, loss.requires_grad))


def validate(recipe, tmp_path, **kw):
    trainer = Trainer(recipe, args(tmp_path, **kw))
    try:
        return trainer.validate()["val"]
    finally:
        trainer.close()


@pytest.mark.parametrize("val_batch_size", [4, 10, 13])
def test_a_zero_dim_val_value_counts_once_per_sample(tmp_path, val_batch_size):
    """47 samples: short last batches; the 0-d form's epoch mean is the per-sample mean."""
    exact = validate(PerSampleVal(IdData(40, 47)), tmp_path / "a")["loss"]
    mean = validate(MeanVal(IdData(40, 47)), tmp_path / "b", val_batch_size=val_batch_size)
    assert mean["loss"] == pytest.approx(exact, rel=1e-6)
    # The mean of batch means would differ: the short last batch would count as a full one.
    batches = [((MeanVal(IdData(40, 47))(x) - y) ** 2).mean().item() for _, x, y in
               torch.utils.data.DataLoader(IdData(40, 47).val, batch_size=val_batch_size)]
    if 47 % val_batch_size:
        assert sum(batches) / len(batches) != pytest.approx(exact, rel=1e-6)


def test_pymarlin_train_and_val_forms_reach_their_callbacks(tmp_path):
    module = PyMarlinRecipe(IdData(40, 47))
    Trainer(module, args(tmp_path, val_batch_size=10)).train()
    steps = [e for e in module.events if e[0] == "end_step"]
    assert steps == [("end_step", k, (10,), (10,)) for k in range(1, 5)]
    # The epoch's 47 only: the check before step 1 does not call the callback.
    assert [e for e in module.events if e[0] == "val"] == [("val", "val", 47, 47)]
    exact = validate(PerSampleVal(IdData(40, 47)), tmp_path / "x")["loss"]
    module2 = PyMarlinRecipe(IdData(40, 47))
    assert validate(module2, tmp_path / "y", val_batch_size=10)["loss"] == \
        pytest.approx(exact, rel=1e-6)


def test_named_columns_reach_on_end_val_epoch_after_a_full_epoch(tmp_path):
    """The covid19 form, ``(global_step, losses, logits, labels, key="default")``: each
    column by position, as PyMarlin passed them; the metrics are those of the *inputs form."""
    module = NamedColumns(IdData(40, 47))
    named = Trainer(module, args(tmp_path / "named", epochs=2, val_batch_size=10))
    named.train()
    assert [e for e in module.events if e[0] == "val"] == \
        [("val", 4, "val", 47, 47), ("val", 8, "val", 47, 47)]
    star = PyMarlinRecipe(IdData(40, 47))
    expected = Trainer(star, args(tmp_path / "star", epochs=2, val_batch_size=10))
    expected.train()
    assert named.last_val_metrics == expected.last_val_metrics
    assert set(named.last_val_metrics["val"]) == {"loss", "mse"}


def test_a_signature_that_cannot_take_the_columns_fails_before_step_one(tmp_path):
    module = TooFewColumns(IdData(40, 47))
    with pytest.raises(StartupCheckError) as err:
        Trainer(module, args(tmp_path, val_batch_size=10)).train()
    message = str(err.value)
    assert "\n" not in message
    assert "on_end_val_epoch(global_step, losses, logits, key='default')" in message
    assert "3 column(s)" in message and "sanity check before training" in message
    assert not [e for e in module.events if e[0] == "end_step"]  # no step was taken
    assert not [e for e in module.events if e[0] == "val"]


def test_an_older_callback_signature_gets_what_it_takes(tmp_path):
    module = OldSignature(IdData(40, 10))
    Trainer(module, args(tmp_path)).train()
    assert [e for e in module.events if e[0] == "end_step"] == \
        [("end_step", k, False) for k in range(1, 5)]


class NoSuperInit(DataProcessor):
    def __init__(self, scale):  # PyMarlin's processors do not call super().__init__()
        self.scale = scale

    def process(self, value, offset):
        return value * self.scale + offset


def test_a_processor_without_super_init_runs_in_a_pool():
    assert NoSuperInit(3).multi_process_data(range(6), 1, process_count=2) == \
        [1, 4, 7, 10, 13, 16]
    assert NoSuperInit(3).multi_process_data(range(6), 0, num_nodes=2, node_rank=1) == \
        [9, 12, 15]
