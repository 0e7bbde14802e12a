"""``trainer.resume_config: accept``: every accepted value is the one in effect after the
resume (optimizer hyper-parameters, scheduler settings, clipping, the batch), not the
checkpoint's."""

import json

import pytest
import torch
from safetensors.torch import load_file

from sailfin import Trainer
from sailfin.cli import main
from sailfin.config import load_config
from tests.recipes import LinearRecipe

CONFIG = """
data: {class_path: tests.recipes.IdData, init_args: {n_train: 40, n_val: 0}}
module: {class_path: tests.trainer.test_accepted.TunableRecipe, init_args: {lr: 0.05}}
trainer: {epochs: 1, train_batch_size: 10, micro_batch_size: 10, writers: [jsonl],
          output_dir: OUT, seed: 3, progress: none, log_every_n_steps: 1,
          val_every_n_epochs: 0}
"""


class TunableRecipe(LinearRecipe):
    """LinearRecipe with the optimizer and schedule settings as recipe arguments."""

    def __init__(self, data, lr: float = 0.05, momentum: float = 0.0, optimizer: str = "sgd",
                 weight_decay: float = 0.0, beta1: float = 0.9, gamma: float = 0.9,
                 step_size: int = 3) -> None:
        super().__init__(data, lr=lr, momentum=momentum)
        self.optimizer, self.weight_decay, self.beta1 = optimizer, weight_decay, beta1
        self.gamma, self.step_size = gamma, step_size

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        if self.optimizer == "adamw":
            opt = torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(self.beta1, 0.999),
                                    weight_decay=self.weight_decay)
        else:
            opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum,
                                  weight_decay=self.weight_decay)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=self.step_size, gamma=self.gamma)
        return [opt], [sched]


def config(tmp_path, out="out"):
    path = tmp_path / f"{out}.yaml"
    path.write_text(CONFIG.replace("OUT", str(tmp_path / out)))
    return str(path)


def logged_lr(tmp_path, out="out"):
    lines = (tmp_path / out / "metrics.jsonl").read_text().splitlines()
    return {e["step"]: e["lr"] for e in map(json.loads, lines) if "lr" in e}


def resumed_trainer(tmp_path, *overrides):
    """Train one epoch (4 steps), then set up a resume with ``overrides`` accepted."""
    cfg = config(tmp_path)
    assert main(["train", cfg]) == 0
    loaded = load_config(cfg, list(overrides) + ["--trainer.epochs", "2",
                                                 "--trainer.resume_config", "accept"])
    trainer = Trainer(loaded.build(), loaded.trainer)
    trainer.setup()
    assert trainer.global_step == 4  # resumed
    return trainer


def test_an_accepted_lr_is_the_lr_after_the_resume(tmp_path, capsys):
    """The issue's reproduction: the logged lr and the weights follow the new lr."""
    runs = {}
    for out, extra in (("same", []), ("changed", ["--module.init_args.lr", "0.5",
                                                  "--trainer.resume_config", "accept"])):
        cfg = config(tmp_path, out)
        assert main(["train", cfg]) == 0
        capsys.readouterr()
        assert main(["train", cfg, "--trainer.epochs", "2"] + extra) == 0
        runs[out] = (logged_lr(tmp_path, out), capsys.readouterr().err,
                     load_file(str(tmp_path / out / "final" / "model.safetensors")))
    err = runs["changed"][1]
    assert ("resume: accepted values in effect from step 5: optimizer 0 lr: 0.045 -> 0.45; "
            "optimizer 0 initial_lr: 0.05 -> 0.5") in err
    # StepLR(step_size 3, gamma 0.9): the lr after step k is lr0 * 0.9 ** (k // 3).
    for step in range(5, 9):
        assert runs["changed"][0][step] == pytest.approx(0.5 * 0.9 ** (step // 3)), step
        assert runs["same"][0][step] == pytest.approx(0.05 * 0.9 ** (step // 3)), step
    same, changed = runs["same"][2], runs["changed"][2]
    assert any(not torch.equal(same[k], changed[k]) for k in same)


def test_accepted_weight_decay_and_betas_are_in_effect(tmp_path):
    cfg = config(tmp_path)
    assert main(["train", cfg, "--module.init_args.optimizer", "adamw"]) == 0
    loaded = load_config(cfg, ["--module.init_args.optimizer", "adamw", "--trainer.epochs", "2",
                               "--module.init_args.weight_decay", "0.25",
                               "--module.init_args.beta1", "0.5",
                               "--trainer.resume_config", "accept"])
    trainer = Trainer(loaded.build(), loaded.trainer)
    trainer.setup()
    try:
        assert trainer.global_step == 4  # resumed
        group = trainer.optimizers[0].param_groups[0]
        assert group["weight_decay"] == 0.25 and group["betas"] == (0.5, 0.999)
        # The per-parameter state (Adam's moments) is the checkpoint's, not a fresh one.
        state = trainer.optimizers[0].state[group["params"][0]]
        assert int(state["step"]) == 4 and state["exp_avg"].abs().sum() > 0
    finally:
        trainer.close()


def test_accepted_momentum_is_in_effect_and_the_buffer_is_kept(tmp_path):
    cfg = config(tmp_path)
    assert main(["train", cfg, "--module.init_args.momentum", "0.5"]) == 0
    loaded = load_config(cfg, ["--module.init_args.momentum", "0.8", "--trainer.epochs", "2",
                               "--trainer.resume_config", "accept"])
    trainer = Trainer(loaded.build(), loaded.trainer)
    trainer.setup()
    try:
        group = trainer.optimizers[0].param_groups[0]
        assert group["momentum"] == 0.8
        assert trainer.optimizers[0].state[group["params"][0]]["momentum_buffer"] is not None
    finally:
        trainer.close()


def test_accepted_scheduler_settings_give_the_new_schedule_at_the_saved_step(tmp_path):
    trainer = resumed_trainer(tmp_path, "--module.init_args.gamma", "0.5",
                              "--module.init_args.step_size", "2")
    try:
        sched = trainer.schedulers[0]
        assert (sched.gamma, sched.step_size, sched.last_epoch) == (0.5, 2, 4)
        assert sched.base_lrs == [0.05]
        assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05 * 0.5 ** 2)
    finally:
        trainer.close()


def test_accepted_clipping_takes_effect(tmp_path):
    """trainer.max_grad_norm: tiny after the resume, so the weights barely move."""
    cfg = config(tmp_path)
    assert main(["train", cfg]) == 0
    loaded = load_config(cfg, ["--trainer.epochs", "2", "--trainer.max_grad_norm", "1e-3",
                               "--trainer.resume_config", "accept"])
    trainer = Trainer(loaded.build(), loaded.trainer)
    trainer.setup()
    before = [p.detach().clone() for p in trainer.module.parameters()]
    trainer.train()
    trainer.close()
    moved = torch.cat([(p.detach() - b).flatten() for p, b in
                       zip(trainer.module.parameters(), before)]).norm().item()
    assert trainer.global_step == 8
    assert 0 < moved <= 4 * 0.05 * 1e-3 * 1.01  # 4 steps of at most lr * max_norm


def test_an_accepted_global_batch_applies_from_the_epoch_boundary(tmp_path):
    trainer = resumed_trainer(tmp_path, "--trainer.train_batch_size", "20",
                              "--trainer.micro_batch_size", "20")
    try:
        assert trainer.plan.global_batch == 20 and trainer.steps_per_epoch == 2
        trainer.train()
        assert trainer.global_step == 6
        assert [len(ids) for ids in trainer.module.step_ids] == [20, 20]
    finally:
        trainer.close()


def test_without_an_accepted_change_nothing_is_reapplied(tmp_path, capsys):
    cfg = config(tmp_path)
    assert main(["train", cfg]) == 0
    assert main(["train", cfg, "--trainer.epochs", "2", "--trainer.resume_config", "accept"]) == 0
    assert "accepted values in effect" not in capsys.readouterr().err
