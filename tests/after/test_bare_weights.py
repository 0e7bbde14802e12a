"""final/bare.safetensors: the recipe's model attribute under its own names, loadable into
the bare nn.Module in one line; final/model.safetensors stays as it was."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file
from torch import nn

from sailfin import ModuleInterface, Trainer, TrainerArguments
from tests.after.recipe import PositionData
from tests.after.runs import trained


def test_the_bare_model_loads_the_final_weights_without_renaming(tmp_path):
    out = trained(tmp_path / "run")
    bare = load_file(str(out / "final" / "bare.safetensors"))
    recipe = load_file(str(out / "final" / "model.safetensors"))
    assert set(recipe) == {f"net.{k}" for k in bare}  # the old file: the recipe's names
    assert all(torch.equal(recipe[f"net.{k}"], v) for k, v in bare.items())
    net = nn.Sequential(nn.Linear(5, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
    net.load_state_dict(load_file(str(out / "final" / "bare.safetensors")))  # the doc's line
    summary = json.loads((out / "summary.json").read_text())
    assert summary["bare_weights"] == {"file": "final/bare.safetensors", "attribute": "net"}


class TwoParts(ModuleInterface):
    def __init__(self, data):
        super().__init__()
        self.data = data
        self.body, self.head = nn.Linear(6, 4), nn.Linear(4, 2)

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        return [torch.optim.SGD(self.parameters(), lr=0.1)], []

    def train_step(self, global_step, batch, device):
        return nn.functional.cross_entropy(self.head(self.body(batch[0])), batch[1])

    def get_val_dataloaders(self, sampler, batch_size):
        return {}


def test_a_recipe_whose_weights_live_in_two_attributes_gets_no_bare_file(tmp_path):
    args = TrainerArguments(epochs=1, train_batch_size=16, output_dir=str(tmp_path),
                            writers=[], progress="none", val_every_n_epochs=0)
    with Trainer(TwoParts(PositionData()), args) as trainer:
        summary = trainer.train()
    assert (tmp_path / "final" / "model.safetensors").is_file()
    assert not (tmp_path / "final" / "bare.safetensors").exists()
    assert "bare_weights" not in summary
