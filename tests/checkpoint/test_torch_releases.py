"""The oldest torch sailfin supports (2.6) lacks ``dcp.load(..., no_dist=...)`` and
``DefaultStager``: the calls in sailfin.compat.torch work without them, and a TypeError of
sailfin's own code is never reported as a damaged checkpoint."""

import inspect

import pytest
import torch
import torch.distributed.checkpoint as dcp

from sailfin import Trainer
from tests.checkpoint.helpers import Crash, CrashAt, assert_same_params, params
from tests.recipes import IdData, LinearRecipe, args

STEP = {"every_n_steps": 2, "at_epoch_end": False}


def run(tmp, crash=None, **kw):
    module = LinearRecipe(IdData(40, 6), dropout=0.2, momentum=0.9)
    trainer = Trainer(module, args(tmp, epochs=2, **{"checkpoint": STEP, **kw}),
                      callbacks=[CrashAt(crash)] if crash else [])
    try:
        trainer.train()
    except Crash:
        pass
    return module, trainer


def test_resume_on_a_dcp_load_without_no_dist(tmp_path, monkeypatch):
    real = dcp.load

    def load_of_torch_2_6(state_dict, *, checkpoint_id=None, storage_reader=None,
                          planner=None, process_group=None):
        return real(state_dict, checkpoint_id=checkpoint_id, storage_reader=storage_reader,
                    planner=planner, process_group=process_group)

    assert "no_dist" not in inspect.signature(load_of_torch_2_6).parameters
    monkeypatch.setattr(dcp, "load", load_of_torch_2_6)
    whole, _ = run(tmp_path / "whole")
    run(tmp_path / "cut", crash=5)
    resumed, trainer = run(tmp_path / "cut")
    assert trainer.resumed_from.name == "step-00000004"
    assert_same_params(params(whole), params(resumed))


def test_a_type_error_of_sailfin_is_not_called_damage(tmp_path, monkeypatch):
    run(tmp_path, crash=5)

    def broken(*a, **kw):
        raise TypeError("load() got an unexpected keyword argument 'no_dist'")

    monkeypatch.setattr(dcp, "load", broken)
    with pytest.raises(TypeError, match="no_dist"):
        run(tmp_path)


def test_async_save_on_a_torch_without_default_stager(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import staging

    from sailfin.checkpoint.staging import stager_reusable

    monkeypatch.delattr(staging, "DefaultStager")
    stager_reusable.cache_clear()
    try:
        whole, _ = run(tmp_path / "whole")
        run(tmp_path / "cut", crash=5, checkpoint={**STEP, "async_save": True})
        resumed, trainer = run(tmp_path / "cut", checkpoint={**STEP, "async_save": True})
    finally:
        stager_reusable.cache_clear()  # the next test asks this torch's own stager
    assert trainer.resumed_from.name == "step-00000004"
    assert_same_params(params(whole), params(resumed))
