"""The elastic tests' recipe, with rank 1 stuck for good in train_step of one step of
torchrun's first attempt (the hang watchdog tests)."""

from __future__ import annotations

import os
import time

from tests.distributed.elastic_recipe import ElasticRecipe


class HangOnceRecipe(ElasticRecipe):
    def __init__(self, data, hang_step: int, **kw) -> None:
        super().__init__(data, **kw)
        self.hang_step = hang_step  # 1-based, as logs count
        self.hang = (os.environ.get("RANK") == "1"
                     and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0")

    def train_step(self, global_step, batch, device):
        if self.hang and global_step + 1 == self.hang_step:
            (self.out / "hang-began").write_text(repr(time.time()))
            while True:
                time.sleep(3600)
        return super().train_step(global_step, batch, device)


class StuckInCheckRecipe(ElasticRecipe):
    """Rank 1's val_step never returns in the sanity batch before the first step."""

    def val_step(self, global_step, batch, device):
        if os.environ.get("RANK") == "1" and not self.step_ids:
            (self.out / "check-began").write_text(repr(time.time()))
            while True:
                time.sleep(3600)
        return super().val_step(global_step, batch, device)


class SlowValidationOnRank1(ElasticRecipe):
    """Rank 1's val_step never returns in the first validation after training began;
    rank 0 goes through its own batches and waits for rank 1's outputs."""

    def val_step(self, global_step, batch, device):
        if os.environ.get("RANK") == "1" and self.step_ids:
            while True:
                time.sleep(3600)
        return super().val_step(global_step, batch, device)
