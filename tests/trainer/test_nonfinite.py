"""trainer.on_nonfinite: stop (exact step and samples), skip, warn."""

import json

import pytest
import torch

from sailfin import Trainer
from sailfin.trainer.safety.nonfinite import NonFiniteGuard, NonFiniteLossError, NonFiniteLossWarning
from tests.recipes import IdData, LinearRecipe, args


class NanAt(LinearRecipe):
    """The loss is NaN (or inf) at the given global steps."""

    def __init__(self, data, bad_steps, value=float("nan"), **kw):
        super().__init__(data, **kw)
        self.bad_steps, self.value = set(bad_steps), value
        self.weights_before_step = {}

    def train_step(self, global_step, batch, device):
        self.weights_before_step.setdefault(global_step, self.linear.weight.detach().clone())
        loss, stats = super().train_step(global_step, batch, device)
        if global_step in self.bad_steps:
            loss = loss * self.value
        return loss, stats


def test_stop_names_step_epoch_and_samples_before_the_weights_change(tmp_path):
    module = NanAt(IdData(50, 0), bad_steps={7})
    trainer = Trainer(module, args(tmp_path, epochs=3, train_batch_size=20,
                                   micro_batch_size=10))
    with pytest.raises(NonFiniteLossError) as info:
        trainer.train()
    err = info.value
    # 3 steps per epoch (20, 20, 10): global step 7 (the 8th) is epoch 3's 2nd step.
    assert (err.global_step, err.epoch, err.step_in_epoch) == (7, 2, 1)
    assert sorted(err.sample_indices) == sorted(sum(module.seen[-2:], []))
    message = str(err)
    assert "global_step=7 (step 2 of epoch 3)" in message and "nan" in message
    assert f"dataset indices [{', '.join(map(str, err.sample_indices))}]" in message
    assert "weights are as they were before that step" in message
    assert "trainer.on_nonfinite" in message
    torch.testing.assert_close(module.linear.weight, module.weights_before_step[7])


def test_deferred_stop_reads_losses_at_the_log_sync_and_still_names_the_step(tmp_path):
    """The accelerator path: no per-step read; found at the next log step, exactly."""
    module = NanAt(IdData(100, 0), bad_steps={5}, value=float("inf"))
    trainer = Trainer(module, args(tmp_path, train_batch_size=10, log_every_n_steps=4))
    trainer.setup()
    trainer.nonfinite = NonFiniteGuard("stop", torch.device("cpu"),
                                       samples=trainer.train_sampler.step_indices, defer=True)
    with pytest.raises(NonFiniteLossError, match="global_step=5 .* is inf") as info:
        trainer.train()
    assert trainer.global_step == 8  # read at the log step after it, not before
    assert info.value.sample_indices == module.step_ids[5]
    assert "updated by that step and 2 after it" in str(info.value)


def test_deferred_guard_checks_at_epoch_end(tmp_path):
    module = NanAt(IdData(30, 0), bad_steps={2})
    trainer = Trainer(module, args(tmp_path, epochs=2, train_batch_size=10,
                                   log_every_n_steps=100))
    trainer.setup()
    trainer.nonfinite = NonFiniteGuard("stop", torch.device("cpu"), defer=True)
    with pytest.raises(NonFiniteLossError, match="samples are not known") as info:
        trainer.train()
    assert trainer.global_step == 3 and info.value.epoch == 0  # epoch 0's end, not epoch 1


def test_skip_drops_the_step_keeps_the_schedule_and_counts(tmp_path):
    module = NanAt(IdData(60, 0), bad_steps={2, 4})
    trainer = Trainer(module, args(tmp_path, train_batch_size=10, on_nonfinite="skip",
                                   log_every_n_steps=3))
    with pytest.warns(NonFiniteLossWarning) as record:
        summary = trainer.train()
    messages = [str(w.message) for w in record]
    assert len(messages) == 2 and "global_step=2 " in messages[0]
    assert "global_step=4 " in messages[1] and "skipped that step" in messages[1]
    assert summary["global_step"] == 6 and summary["samples_seen"] == 60
    assert summary["nonfinite_steps"] == 2
    assert trainer.schedulers[0].last_epoch == 4  # 6 steps, 2 skipped
    assert torch.isfinite(module.linear.weight).all()
    torch.testing.assert_close(module.weights_before_step[3], module.weights_before_step[2])
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [e.get("nonfinite_steps") for e in events if e["split"] == "train"] == [1, 2]


def test_warn_carries_on_and_counts(tmp_path):
    module = NanAt(IdData(40, 0), bad_steps={1})
    trainer = Trainer(module, args(tmp_path, train_batch_size=10, on_nonfinite="warn"))
    with pytest.warns(NonFiniteLossWarning) as record:
        summary = trainer.train()
    assert "global_step=1 " in str(record[0].message) and "carrying on" in str(record[0].message)
    assert summary["global_step"] == 4
    assert not torch.isfinite(module.linear.weight).all()  # the NaN step was applied ...
    assert summary["nonfinite_steps"] == 3  # ... so steps 1, 2 and 3 all had NaN losses


def test_guard_modes_and_bad_policy():
    assert not NonFiniteGuard("stop", torch.device("cpu")).deferred
    assert NonFiniteGuard("stop", torch.device("cpu"), world_size=2).deferred
    assert NonFiniteGuard("warn", torch.device("meta")).deferred  # any accelerator
    assert not NonFiniteGuard("skip", torch.device("meta")).deferred  # must read per step
    with pytest.raises(ValueError, match="skip must read each loss"):
        NonFiniteGuard("skip", torch.device("cpu"), defer=True)
    with pytest.raises(ValueError, match="stop, skip or warn"):
        NonFiniteGuard("halt", torch.device("cpu"))


def test_finite_run_is_untouched(tmp_path):
    summary = Trainer(LinearRecipe(IdData(40, 0)), args(tmp_path)).train()
    assert summary["nonfinite_steps"] == 0


def test_the_flag_a_snapshot_holds_reads_each_loss_once_and_stays_false(monkeypatch):
    """A deferred guard's ``all_finite`` (asked at every memory snapshot) reads only the
    losses since it was last asked: a snapshot every step costs the same at step 500 as
    at step 1. A non-finite loss keeps the flag false until ``check`` reads it; the flag
    a snapshot already holds does not change."""
    guard = NonFiniteGuard("stop", torch.device("cpu"), defer=True)
    stacked = []
    real_stack = torch.stack
    monkeypatch.setattr(torch, "stack", lambda ts, *a, **k: stacked.append(len(ts))
                        or real_stack(ts, *a, **k))
    flags = []
    for step in range(1, 201):
        guard.observe(torch.tensor(float("nan") if step == 50 else 1.0), step, 0, step - 1)
        flags.append(guard.all_finite())
    assert stacked == [1] * 200
    assert [bool(f) for f in flags] == [True] * 49 + [False] * 151
    monkeypatch.undo()
    with pytest.raises(NonFiniteLossError, match="global_step=50 "):
        guard.check()
    guard.observe(torch.tensor(1.0), 201, 0, 200)
    assert bool(guard.all_finite()) and guard.all_finite() is guard.all_finite()
