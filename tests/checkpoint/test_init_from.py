"""trainer.init_from: a new run starts from a checkpoint's (or a .safetensors file's)
weights only; a run with a checkpoint of its own resumes instead."""

import json

import pytest
import torch

from sailfin import Trainer
from sailfin.checkpoint import CheckpointError
from sailfin.trainer.safety.startup_checks import StartupCheckError
from tests.checkpoint.helpers import assert_same_params, final_weights, params
from tests.recipes import IdData, LinearRecipe, args
from tests.trainer.test_startup_checks import OneCycle


class Probe(LinearRecipe):
    """Records the weights at the start of the first step."""

    def on_begin_train_epoch(self, global_step, epoch):
        if global_step == 0:
            self.initial = {k: v.detach().clone() for k, v in self.state_dict().items()}


def test_a_one_cycle_run_continues_with_a_new_schedule_from_its_weights(tmp_path, capfd):
    """The way out the OneCycleLR message names."""
    first = OneCycle(IdData(40, 10))
    Trainer(first, args(tmp_path / "a", epochs=2)).train()
    with pytest.raises(StartupCheckError):
        Trainer(OneCycle(IdData(40, 10)), args(tmp_path / "a", epochs=3)).train()
    ckpt = tmp_path / "a" / "checkpoints" / "step-00000008"
    module = type("P", (Probe, OneCycle), {})(IdData(40, 10))
    trainer = Trainer(module, args(tmp_path / "b", epochs=1, init_from=str(ckpt)))
    summary = trainer.train()
    assert trainer.resumed_from is None and summary["global_step"] == 4
    assert_same_params(params(first), module.initial)
    assert trainer.schedulers[0].last_epoch == 4  # a new schedule
    assert f"init_from: weights from {ckpt} (checkpoint at step 8)" in capfd.readouterr().err


def test_init_from_a_safetensors_file_and_a_directory_of_checkpoints(tmp_path):
    first = LinearRecipe(IdData(40, 10))
    Trainer(first, args(tmp_path / "a", epochs=2)).train()
    for source in (tmp_path / "a" / "final" / "model.safetensors", tmp_path / "a" / "checkpoints"):
        module = Probe(IdData(40, 10))
        Trainer(module, args(tmp_path / source.name, init_from=str(source))).train()
        assert_same_params(final_weights(tmp_path / "a"), module.initial)


def test_a_run_with_its_own_checkpoint_resumes_instead(tmp_path):
    Trainer(LinearRecipe(IdData(40, 10)), args(tmp_path / "a", epochs=1)).train()
    Trainer(LinearRecipe(IdData(40, 10)),
            args(tmp_path / "b", epochs=1, init_from=str(tmp_path / "a" / "checkpoints"))).train()
    trainer = Trainer(LinearRecipe(IdData(40, 10)),
                      args(tmp_path / "b", epochs=2,
                           init_from=str(tmp_path / "a" / "checkpoints")))
    trainer.train()
    assert trainer.resumed_from is not None and trainer.resumed_from.manifest["step"] == 4
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["global_step"] == 8


def test_bad_init_from_paths_name_the_key(tmp_path):
    with pytest.raises(CheckpointError, match="trainer.init_from: .* does not exist"):
        Trainer(LinearRecipe(IdData(40, 10)),
                args(tmp_path, init_from=str(tmp_path / "none.safetensors"))).train()
    with pytest.raises(CheckpointError, match="trainer.init_from: .*does not exist"):
        Trainer(LinearRecipe(IdData(40, 10)),
                args(tmp_path, init_from=str(tmp_path / "nothing"))).train()
    Trainer(LinearRecipe(IdData(40, 10)), args(tmp_path / "a")).train()

    class Wider(LinearRecipe):
        def __init__(self, data):
            super().__init__(data)
            self.extra = torch.nn.Linear(4, 4)

    with pytest.raises(CheckpointError, match=r"(?s)init_from: the weights in .* do not fit "
                                              r"this model: .*extra.weight"):
        Trainer(Wider(IdData(40, 10)),
                args(tmp_path / "b", init_from=str(tmp_path / "a" / "checkpoints"))).train()
