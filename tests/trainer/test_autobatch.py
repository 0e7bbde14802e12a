"""micro_batch_size: auto finds the largest micro-batch that fits and trains exactly as
a run with that size fixed."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from sailfin import Trainer
from sailfin.config import ConfigError
from sailfin.data import BatchPlan
from sailfin.trainer.features.autobatch import AutoMicroBatch, MicroBatchError
from tests.recipes import IdData, LinearRecipe, args
from tests.trainer.oom_recipes import OomRecipe

TRAIN = {"epochs": 2, "train_batch_size": 16, "checkpoint": {"at_epoch_end": False}}


def test_plan_lists_the_micro_batch_sizes_largest_first():
    assert BatchPlan.micro_batch_sizes(24, 2) == (12, 6, 4, 3, 2, 1)
    assert BatchPlan.micro_batch_sizes(24, 2, ceiling=5) == (4, 3, 2, 1)
    assert BatchPlan.micro_batch_sizes(16, 1) == (16, 8, 4, 2, 1)
    with pytest.raises(ConfigError, match="does not split over 3"):
        BatchPlan.micro_batch_sizes(16, 3)


def test_config_accepts_auto_and_names_the_key_for_other_words(tmp_path):
    assert args(tmp_path, micro_batch_size="auto").micro_batch_size == "auto"
    with pytest.raises(ConfigError, match="trainer.micro_batch_size must be an integer or auto"):
        args(tmp_path, micro_batch_size="big")


@pytest.mark.parametrize("after_first", [False, True])
def test_auto_finds_the_size_and_trains_as_that_size_fixed(tmp_path, after_first, caplog):
    """Out of memory above 5 samples: 16 and 8 fail, 4 fits; with after_first the failed
    attempts had already accumulated a micro-batch's gradients, which must be dropped."""
    caplog.set_level(logging.INFO, logger="sailfin")
    data = {"n_train": 100, "n_val": 0}
    recipe = {"momentum": 0.9}
    ref = LinearRecipe(IdData(**data), **recipe)
    Trainer(ref, args(tmp_path / "fixed", micro_batch_size=4, **TRAIN)).train()
    auto = OomRecipe(IdData(**data), limit=5, after_first=after_first, **recipe)
    trainer = Trainer(auto, args(tmp_path / "auto", micro_batch_size="auto", **TRAIN))
    summary = trainer.train()
    assert auto.ooms == 2  # 16, then 8; 4 is kept for the rest of the run
    assert trainer.plan.micro_batch == 4 and trainer.plan.accumulation == 4
    assert auto.step_ids == ref.step_ids  # the same samples in every step, each once
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(auto.state_dict()[key], value, rtol=1e-6, atol=1e-7)
    assert auto.events.count(("begin_epoch", 0, 0)) == 1  # a redo is not a new epoch
    on_disk = json.loads((tmp_path / "auto" / "summary.json").read_text())
    assert on_disk["micro_batch_size"] == summary["micro_batch_size"] == 4
    assert on_disk["auto_micro_batch"] == {
        "micro_batch_size": 4, "tried": [16, 8, 4],
        "out_of_memory_steps": [{"step": 1, "size": 16}, {"step": 1, "size": 8}]}
    said = caplog.text
    assert "micro_batch_size auto: step 1 runs again with micro-batch 8 (16 ran out" in said
    assert "micro_batch_size auto: 4 fits" in said
    lr_ref = [e for e in (tmp_path / "fixed" / "metrics.jsonl").read_text().splitlines()]
    lr_auto = [e for e in (tmp_path / "auto" / "metrics.jsonl").read_text().splitlines()]
    assert [json.loads(e).get("lr") for e in lr_auto] == [json.loads(e).get("lr") for e in lr_ref]


def test_a_resume_starts_from_the_checkpoint_size(tmp_path):
    data = {"n_train": 64, "n_val": 0}
    a = {**TRAIN, "micro_batch_size": "auto", "checkpoint": {"every_n_steps": 2}}
    first = OomRecipe(IdData(**data), limit=3)
    Trainer(first, args(tmp_path, max_steps=3, **a)).train()
    assert first.ooms == 3  # 16, 8, 4
    again = OomRecipe(IdData(**data), limit=3)
    trainer = Trainer(again, args(tmp_path, **a))
    trainer.setup()
    assert trainer.plan.micro_batch == 2  # before any step
    trainer.train()
    assert again.ooms == 0


def test_a_resize_searches_again(tmp_path):
    auto = AutoMicroBatch(global_batch=16, world_size=1)
    auto.load_state_dict({"size": 4, "world_size": 2, "global_batch": 16})
    trainer = Trainer(LinearRecipe(IdData(32, 0)), args(tmp_path, train_batch_size=16,
                                                        micro_batch_size="auto"))
    trainer.setup()
    auto.start(trainer)
    assert auto.size == 16 == trainer.plan.micro_batch


def test_nothing_fits_stops_with_a_message(tmp_path):
    module = OomRecipe(IdData(40, 0), limit=0)
    with pytest.raises(MicroBatchError, match="even a micro-batch of 1 sample"):
        Trainer(module, args(tmp_path, train_batch_size=4, micro_batch_size="auto")).train()


def test_a_fixed_micro_batch_lets_out_of_memory_through(tmp_path):
    module = OomRecipe(IdData(40, 0), limit=2)
    with pytest.raises(torch.OutOfMemoryError):
        Trainer(module, args(tmp_path, train_batch_size=4, micro_batch_size=4)).train()


def test_after_the_probing_steps_a_rank_cannot_retry_and_says_what_to_set():
    auto = AutoMicroBatch(global_batch=64, world_size=2, rank=1)
    assert auto.probing
    auto.clean_steps = 2  # the ranks agreed on 32 two steps ago
    assert not auto.probing
    with pytest.raises(MicroBatchError, match=r"rank 1 ran out of memory at step 8 with "
                                              r"micro_batch_size 32 \(auto\).*Set "
                                              r"trainer.micro_batch_size to 16 or smaller"):
        auto.out_of_memory(step=7, global_step=7)
