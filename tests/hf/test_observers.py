"""Observing never changes a run, on a model sailfin did not write: a Hugging Face GPT-2
from a config trains to bit-identical weights with every observer off and with all of them
on (a disk checkpoint and a memory snapshot every step, EMA, the progress bar)."""

import shutil

import torch

from tests.hf.helpers import train

OBSERVED = dict(ema={"decay": 0.9}, progress="bar",
                checkpoint={"every_n_steps": 1, "at_epoch_end": True,
                            "memory": {"every_n_steps": 1}})
QUIET = dict(progress="none", checkpoint={"at_epoch_end": False})


def test_gpt2_weights_are_the_same_with_every_observer_on(data_dir, tmp_path):
    off_model, _, _ = train("causal_lm", data_dir, tmp_path / "off", **QUIET)
    try:
        on_model, trainer, summary = train("causal_lm", data_dir, tmp_path / "on", **OBSERVED)
        assert summary["global_step"] == 4
        assert (tmp_path / "on" / "checkpoints" / "step-00000004").is_dir()  # it did save
    finally:
        shutil.rmtree(tmp_path / "on", ignore_errors=True)  # the snapshots' owner goes
    want, got = off_model.state_dict(), on_model.state_dict()
    assert want.keys() == got.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), f"{key} changed by observing the run"
