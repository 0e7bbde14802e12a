"""Errors at the start, not after an epoch: the validation sanity batch, the first
train_step's return, schedulers that cannot run as long as the run; and PyMarlin's
gpu_batch_size_limit and max_val_steps_per_epoch through the trainer."""

import json

import pytest
import torch
from torch import nn

from sailfin import Trainer
from sailfin.trainer.safety.startup_checks import StartupCheckError
from tests.checkpoint.helpers import assert_same_params, metric_lines, params
from tests.recipes import IdData, LinearRecipe, args


class TupleVal(LinearRecipe):
    def val_step(self, global_step, batch, device):  # PyMarlin's (loss, preds) form
        ids, x, y = batch
        pred = self(x)
        return ((pred - y) ** 2).mean(), pred


class MeanVal(LinearRecipe):
    def val_step(self, global_step, batch, device):  # a batch mean: 0-d
        ids, x, y = batch
        return {"id": ids, "loss": ((self(x) - y) ** 2).mean()}


class LogitsTrain(LinearRecipe):
    def train_step(self, global_step, batch, device):  # PyMarlin's (loss, logits)
        ids, x, y = batch
        self.seen.append(ids.tolist())
        pred = self(x)
        return nn.functional.mse_loss(pred, y), pred


class PerSampleTrain(LinearRecipe):
    def train_step(self, global_step, batch, device):
        ids, x, y = batch
        self.seen.append(ids.tolist())
        return (self(x) - y) ** 2


class SeesLoss(LinearRecipe):
    def on_end_train_step(self, global_step, loss, stats):
        self.events.append(("loss", loss.requires_grad, loss.grad_fn))


class CountsValidations(LinearRecipe):
    """Keeps its count of validations in get_state, as a hand-made early stop would."""

    validations = 0

    def on_end_val_epoch(self, global_step, outputs, key="val"):
        self.events.append(("callback", global_step, self.sanity_checking, len(outputs["id"])))
        self.validations += 1
        return {"validations": float(self.validations)}

    def get_state(self):
        return {"validations": self.validations}

    def update_state(self, state):
        self.validations = state["validations"]


def train(module, tmp_path, **kw):
    return Trainer(module, args(tmp_path, **kw)).train()


class FloatVal(LinearRecipe):
    def val_step(self, global_step, batch, device):  # neither a dict nor a tuple
        ids, x, y = batch
        return float(((self(x) - y) ** 2).mean())


def test_a_val_step_of_the_wrong_type_fails_before_the_first_step(tmp_path):
    module = FloatVal(IdData(40, 10))
    with pytest.raises(StartupCheckError, match=r"val_step \(validation set 'val', sanity "
                                                r"check before training.*returned float"):
        train(module, tmp_path, epochs=2)
    assert module.seen == []  # no training step ran


def test_pymarlin_tuple_and_zero_dim_val_outputs_are_accepted(tmp_path):
    """(#28) PyMarlin's forms pass the start-up check; their exactness is tested in
    tests/trainer/test_pymarlin_forms.py."""
    for i, recipe in enumerate((PyMarlinVal, MeanValMetric)):
        train(recipe(IdData(40, 10)), tmp_path / str(i))


class MeanValMetric(MeanVal):
    def on_end_val_epoch(self, global_step, outputs, key="val"):
        return {"loss": outputs["loss"].mean()}


class PyMarlinVal(TupleVal):
    def on_end_val_epoch(self, global_step, *inputs, key="default"):
        losses, preds = inputs
        return {"loss": losses.mean()}


def test_the_sanity_check_leaves_the_run_bit_identical(tmp_path):
    """Dropout draws from torch's stream: the sanity batch must not move it."""
    runs = {}
    for n in (0, 2):
        module = LinearRecipe(IdData(47, 9), dropout=0.3, momentum=0.9)
        train(module, tmp_path / str(n), epochs=2, sanity_val_batches=n, val_batch_size=4)
        runs[n] = module
    assert_same_params(params(runs[0]), params(runs[2]))
    assert metric_lines(tmp_path / "0") == metric_lines(tmp_path / "2")
    assert runs[0].events == runs[2].events  # the check's on_end_val_epoch is not counted


def test_the_check_never_calls_on_end_val_epoch_unless_the_recipe_asks(tmp_path):
    """A callback that counts (PyMarlin's test_train_callbacks counts 3 calls for 3
    epochs), saves or steps something must not run once more before step 1."""
    module = CountsValidations(IdData(47, 9))
    train(module, tmp_path / "on", epochs=3, sanity_val_batches=2, val_batch_size=4)
    calls = [e for e in module.events if e[0] == "callback"]
    assert calls == [("callback", 5, False, 9), ("callback", 10, False, 9),
                     ("callback", 15, False, 9)]
    assert module.validations == 3


class AsksForTheCallback(CountsValidations):
    sanity_check_on_end_val_epoch = True


def test_a_recipe_that_asks_gets_the_call_before_step_1_and_its_state_put_back(tmp_path):
    module = AsksForTheCallback(IdData(47, 9))
    train(module, tmp_path / "on", epochs=2, sanity_val_batches=2, val_batch_size=4)
    calls = [e for e in module.events if e[0] == "callback"]
    # Before step 1, flagged, on the two check batches' 8 samples; then each epoch's end.
    assert calls == [("callback", 0, True, 8), ("callback", 5, False, 9),
                     ("callback", 10, False, 9)]
    assert module.validations == 2 and not module.sanity_checking
    off = AsksForTheCallback(IdData(47, 9))
    train(off, tmp_path / "off", epochs=2, sanity_val_batches=0, val_batch_size=4)
    assert metric_lines(tmp_path / "on") == metric_lines(tmp_path / "off")  # 1.0, 2.0


class WrongSignature(LinearRecipe):
    def on_end_val_epoch(self, global_step):  # cannot take the outputs
        raise AssertionError("the check must not call it")


def test_a_callback_signature_that_cannot_take_the_outputs_fails_before_step_1(tmp_path):
    module = WrongSignature(IdData(40, 10))
    with pytest.raises(StartupCheckError, match=r"on_end_val_epoch\(global_step\) cannot "
                                                r"take \(global_step, outputs, key\)"):
        train(module, tmp_path)
    assert module.seen == []


def test_train_step_returning_loss_and_logits_is_pymarlins_form(tmp_path):
    """(#28) PyMarlin's (loss, logits): accepted; the logits go to on_end_train_step."""
    module = LogitsTrain(IdData(40, 10))
    train(module, tmp_path)
    assert len(module.seen) == 4


def test_a_per_sample_train_loss_is_refused_at_the_first_step(tmp_path):
    with pytest.raises(StartupCheckError, match=r"loss of shape \[10\]; return the batch's "
                                                r"MEAN loss"):
        train(PerSampleTrain(IdData(40, 10)), tmp_path)


def test_on_end_train_step_receives_a_detached_loss(tmp_path):
    module = SeesLoss(IdData(40, 10))
    train(module, tmp_path)
    seen = [e for e in module.events if e[0] == "loss"]
    assert len(seen) == 4 and all(e == ("loss", False, None) for e in seen)


def test_gpu_batch_size_limit_from_python_is_a_ceiling(tmp_path):
    module = LinearRecipe(IdData(40, 10))
    trainer = Trainer(module, args(tmp_path, train_batch_size=12, micro_batch_size=None,
                                   gpu_batch_size_limit=5))
    trainer.train()
    assert (trainer.plan.micro_batch, trainer.plan.accumulation) == (4, 3)
    assert [len(ids) for ids in module.seen[:3]] == [4, 4, 4]


def test_max_val_steps_per_epoch_caps_validation(tmp_path):
    module = LinearRecipe(IdData(40, 30))
    summary = train(module, tmp_path, val_batch_size=4, max_val_steps_per_epoch=2)
    assert summary["val"]["count"] == 8


class OneCycle(LinearRecipe):
    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        total = estimated_global_steps_per_epoch * epochs
        return [opt], [torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=self.lr,
                                                           total_steps=total)]


def test_extending_a_one_cycle_run_stops_before_the_first_step(tmp_path):
    train(OneCycle(IdData(40, 10)), tmp_path, epochs=2)
    module = OneCycle(IdData(40, 10))
    with pytest.raises(StartupCheckError, match=r"(?s)scheduler 0 \(OneCycleLR\) was built for "
                                                r"total_steps=8 and has taken 8; this run takes "
                                                r"4 more.*cannot be extended.*"
                                                r"--trainer.init_from .*step-00000008 "
                                                r"--trainer.output_dir NEW_DIR"):
        train(module, tmp_path, epochs=3)
    assert module.seen == []


def test_a_one_cycle_schedule_shorter_than_a_fresh_run_is_caught(tmp_path):
    class Short(OneCycle):
        def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
            return super().get_optimizers_schedulers(estimated_global_steps_per_epoch, 1)

    with pytest.raises(StartupCheckError, match="Build it with total_steps = "
                                                "estimated_global_steps_per_epoch \\* epochs"):
        train(Short(IdData(40, 10)), tmp_path, epochs=2)


def test_a_finished_run_asked_to_train_again_says_nothing_was_trained(tmp_path, capfd):
    """Re-running a finished run's command trained nothing and ended like a success: it now
    says so once, naming the directory, the step and both ways on, returns the finished
    run's summary marked nothing_trained, and leaves the finished run's files as they were."""
    train(LinearRecipe(IdData(40, 10)), tmp_path, epochs=2)
    before = {p.name: p.read_bytes() for p in (tmp_path / "summary.json",
                                               tmp_path / "final" / "model.safetensors")}
    capfd.readouterr()
    for epochs in (2, 1):  # the same command again, or fewer epochs
        module = LinearRecipe(IdData(40, 10))
        summary = train(module, tmp_path, epochs=epochs)
        done = summary["nothing_trained"]
        assert (done["step"], done["epoch"], done["output_dir"]) == (8, 2, str(tmp_path))
        assert summary["global_step"] == 8 and module.seen == []
        said = [line for line in capfd.readouterr().err.splitlines() if "nothing" in line]
        assert said == [f"sailfin: {done['message']}"]
        assert done["message"].startswith(f"nothing trained: the run in {tmp_path} finished "
                                          f"at step 8 (at the end of epoch 2; trainer.epochs "
                                          f"{epochs})")
        assert f"--trainer.output_dir {tmp_path}-2" in said[0]
        assert "raise trainer.epochs" in said[0]
    assert {p.name: p.read_bytes() for p in (tmp_path / "summary.json",
                                             tmp_path / "final" / "model.safetensors")} == before
    # The advice works: more epochs continue the run.
    summary = train(LinearRecipe(IdData(40, 10)), tmp_path, epochs=3)
    assert summary["global_step"] == 12 and "nothing_trained" not in summary
    assert json.loads((tmp_path / "summary.json").read_text())["global_step"] == 12


def test_a_run_ended_by_max_steps_names_max_steps_as_the_way_on(tmp_path):
    """More epochs would not continue a run that max_steps ended: the advice names the
    limit the run reached."""
    train(LinearRecipe(IdData(40, 10)), tmp_path, epochs=5, max_steps=6)
    done = train(LinearRecipe(IdData(40, 10)), tmp_path, epochs=5, max_steps=6)
    message = done["nothing_trained"]["message"]
    # 4 steps an epoch: step 6 is 2 steps into the second epoch (counted from 1).
    assert "(2 step(s) into epoch 2; trainer.epochs 5, trainer.max_steps 6)" in message
    assert message.endswith("or raise trainer.max_steps to continue this one"), message
    assert train(LinearRecipe(IdData(40, 10)), tmp_path, epochs=5,
                 max_steps=8)["global_step"] == 8


def test_a_restart_of_a_finished_job_ends_without_error(tmp_path, monkeypatch, capfd):
    """torchrun --max-restarts (or a Slurm requeue) restarting a job whose run had finished:
    the job is done, not refused."""
    train(LinearRecipe(IdData(40, 10)), tmp_path, epochs=2)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    summary = train(LinearRecipe(IdData(40, 10)), tmp_path, epochs=2)
    assert summary["global_step"] == 8 and "nothing_trained" not in summary
    assert f"resume: the run in {tmp_path} had finished at step 8 before this restart" in \
        capfd.readouterr().err


def test_progress_never_passes_100_percent_after_fewer_epochs(tmp_path, capsys, monkeypatch):
    """The digits demo re-run with --trainer.epochs 3 printed 'step 345/69 (500%)' (a
    restart of a finished job still resumes past its new end)."""
    train(LinearRecipe(IdData(40, 10)), tmp_path, epochs=3, progress="lines")
    capsys.readouterr()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    train(LinearRecipe(IdData(40, 10)), tmp_path, epochs=1, progress="lines")
    out = capsys.readouterr().out
    assert "step 12/12 (100%)" in out and "12/4" not in out
