"""Observing never changes a run, on a model sailfin did not write: a Hugging Face GPT-2
from a config trains to bit-identical weights with every observer off and with all of them
on (a disk checkpoint, synchronous or async, and a memory snapshot every step, EMA, the
progress bar)."""

import shutil

import pytest
import torch

from tests.hf.helpers import train

OBSERVED = dict(ema={"decay": 0.9}, progress="bar",
                checkpoint={"every_n_steps": 1, "at_epoch_end": True,
                            "memory": {"every_n_steps": 1}})
QUIET = dict(progress="none", checkpoint={"at_epoch_end": False})


@pytest.mark.parametrize("async_save", [False, True, "fresh stagers"])
def test_gpt2_weights_are_the_same_with_every_observer_on(data_dir, tmp_path, async_save,
                                                         monkeypatch):
    """``fresh stagers``: async saves on a torch whose DCP stager stages only once (2.11),
    each save on new stagers (sailfin.checkpoint.staging.stager_reusable)."""
    off_model, _, _ = train("causal_lm", data_dir, tmp_path / "off", **QUIET)
    observed = {**OBSERVED, "checkpoint": {**OBSERVED["checkpoint"],
                                           "async_save": bool(async_save)}}
    if async_save == "fresh stagers":
        import torch.distributed.checkpoint.staging as dcp_staging

        from sailfin.checkpoint.staging import stager_reusable
        from tests.checkpoint.test_checkpointer import StagesOnce

        monkeypatch.setattr(StagesOnce, "real", dcp_staging.DefaultStager, raising=False)
        monkeypatch.setattr(dcp_staging, "DefaultStager", StagesOnce)
        stager_reusable.cache_clear()
        assert not stager_reusable()
    try:
        on_model, trainer, summary = train("causal_lm", data_dir, tmp_path / "on", **observed)
        assert summary["global_step"] == 4
        assert (tmp_path / "on" / "checkpoints" / "step-00000004").is_dir()  # it did save
    finally:
        shutil.rmtree(tmp_path / "on", ignore_errors=True)  # the snapshots' owner goes
        if async_save == "fresh stagers":
            from sailfin.checkpoint.staging import stager_reusable

            stager_reusable.cache_clear()  # the next test asks this torch's own stager
    want, got = off_model.state_dict(), on_model.state_dict()
    assert want.keys() == got.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), f"{key} changed by observing the run"


def test_gpt2_ema_saved_by_async_saves_is_the_average_the_run_reports(data_dir, tmp_path):
    """EMA's averages go to DCP with the model (staged by its stager under async_save): a
    GPT-2 run cut at step 2 and resumed ends with the EMA of the uninterrupted run, bit for
    bit, and the newest checkpoint, opened with torch alone, holds exactly the averages
    final/ema.safetensors reports."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ema = {"decay": 0.9}
    train("causal_lm", data_dir, tmp_path / "whole", ema=ema, **QUIET)
    saves = {"every_n_steps": 1, "at_epoch_end": False, "async_save": True}
    train("causal_lm", data_dir, tmp_path / "cut", ema=ema, progress="none",
          checkpoint=saves, max_steps=2)
    train("causal_lm", data_dir, tmp_path / "cut", ema=ema, progress="none",
          checkpoint=saves)
    want = load_file(str(tmp_path / "whole" / "final" / "ema.safetensors"))
    got = load_file(str(tmp_path / "cut" / "final" / "ema.safetensors"))
    assert want.keys() == got.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), f"{key}: the resumed run's EMA differs"

    newest = tmp_path / "cut" / "checkpoints" / "step-00000004"
    dcp_to_torch_save(str(newest / "shards"), str(tmp_path / "step-4.pt"))
    saved = torch.load(tmp_path / "step-4.pt", weights_only=True)["callbacks/ema"]["shadow"]
    assert saved and len(saved) <= len(got)
    for name, value in saved.items():
        assert torch.equal(value, got[name]), f"{name}: the checkpoint's EMA is not the final"


def test_gpt2_trained_by_the_command_is_the_same_as_by_the_trainer(data_dir, tmp_path):
    """``sailfin train`` watches set-up for a stop (its signal handlers, and the check at
    the first step for a stop set-up code swallowed): the GPT-2 it saves is bit for bit
    the one ``Trainer`` trains without them, and the weights it saves are the model's."""
    import yaml
    from safetensors.torch import load_file

    from sailfin.cli import main
    from tests.hf.helpers import write, yaml_config

    off_model, _, _ = train("causal_lm", data_dir, tmp_path / "off", **QUIET)
    cfg = yaml.safe_load(yaml_config("causal_lm", data_dir, tmp_path / "on",
                                     val_batch_size=16, **QUIET))
    cfg["module"]["init_args"].update(warmup_steps=2, weight_decay=0.01)  # helpers.module's
    assert main(["train", write(tmp_path / "c.yaml", yaml.safe_dump(cfg))]) == 0
    saved = load_file(str(tmp_path / "on" / "final" / "model.safetensors"))
    want = off_model.state_dict()
    assert set(want) >= set(saved) and len(saved) >= 8
    for key, value in saved.items():
        assert torch.equal(value, want[key]), f"{key} changed by the command"
