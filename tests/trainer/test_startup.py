"""Start-up work sailfin does once, not twice: one write probe per directory, and seeding
without queueing seeds for devices the process cannot have."""

import os

import numpy as np
import torch

from sailfin import Trainer
from sailfin.logging import destination
from sailfin.utils.seed import seed_everything
from tests.recipes import IdData, LinearRecipe, args


def test_seed_everything_seeds_like_torch_manual_seed():
    seed_everything(123)
    ours = (torch.rand(4), np.random.rand(2))
    torch.manual_seed(123)
    np.random.seed(123)
    assert torch.equal(ours[0], torch.rand(4)) and np.array_equal(ours[1], np.random.rand(2))


def test_output_directory_is_probed_once_per_setup(tmp_path, monkeypatch):
    probes = []
    real_open = os.open

    def counting_open(path, *a, **kw):
        if ".sailfin-write-probe-" in str(path):
            probes.append(os.path.dirname(path))
        return real_open(path, *a, **kw)

    monkeypatch.setattr(destination.os, "open", counting_open)
    trainer = Trainer(LinearRecipe(IdData(20, 0)), args(tmp_path, writers=["jsonl", "csv"]))
    trainer.setup()
    trainer.close()
    assert probes == [str(tmp_path)]  # the trainer's check; the writers' are the same dir


def test_a_directory_is_probed_again_later(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(destination.os, "fsync", calls.append)
    destination.check_directory(str(tmp_path), "jsonl")
    destination.check_directory(str(tmp_path), "jsonl")
    assert len(calls) == 1
    monkeypatch.setattr(destination, "_PROVEN_SECONDS", 0.0)
    destination.check_directory(str(tmp_path), "jsonl")
    assert len(calls) == 2
