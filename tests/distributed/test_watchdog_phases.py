"""The watchdog names the phase it saw, and gives known-slow phases (checkpoint save,
validation with on_end_val_epoch, callbacks) their own, longer limit."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from sailfin.checkpoint import DirectoryCheckpointer
from sailfin.config import ConfigError
from sailfin.config.distributed import DistArguments
from sailfin.distributed.watchdog import (BACKWARD, CHECKPOINT_SAVE, VALIDATION, RankRecord,
                                          hang_report, resolve_slow_seconds)
from tests.distributed.elastic_helpers import ROOT
from tests.recipes import LinearRecipe

SLEEP = float(os.environ.get("SLOW_PHASE_SECONDS", "2.5"))


class SlowValRecipe(LinearRecipe):
    """on_end_val_epoch takes SLEEP seconds (a large metric computed on the host)."""

    def on_end_val_epoch(self, global_step, outputs, key="val"):
        time.sleep(SLEEP)
        return super().on_end_val_epoch(global_step, outputs, key)


class SlowCheckpointer(DirectoryCheckpointer):
    """Every save takes SLEEP seconds more (a slow file system)."""

    def save(self, snapshot):
        time.sleep(SLEEP)
        super().save(snapshot)


def test_the_report_names_the_phase_and_the_key_that_raises_its_limit():
    save = hang_report([RankRecord(0, 4, CHECKPOINT_SAVE, 8.2), RankRecord(1, 4,
                                                                          CHECKPOINT_SAVE, 8.0)],
                       2, slow_seconds=8)
    assert save[0] == ("hang watchdog: no progress for more than 8 s "
                       "(trainer.distributed.hang_seconds_slow_phases); all ranks in checkpoint "
                       "save for 8 s: if this work is this slow on purpose (a large save, a "
                       "long validation or callback), raise "
                       "trainer.distributed.hang_seconds_slow_phases")
    stuck = hang_report([RankRecord(0, 4, BACKWARD, 11), RankRecord(1, 4, BACKWARD, 11)], 10,
                        slow_seconds=40)
    assert stuck[0].startswith("hang watchdog: no progress for more than 10 s "
                               "(trainer.distributed.hang_seconds); all ranks in backward")
    one = hang_report([RankRecord(0, 4, VALIDATION, 41), RankRecord(1, 5, BACKWARD, 1)], 10,
                      slow_seconds=40)
    assert "waiting for rank 0 (in validation)" in one[0] and "more than 40 s" in one[0]


def test_the_slow_phase_limit_setting():
    assert resolve_slow_seconds("auto", 300) == 1200 and resolve_slow_seconds(None, 5) == 5
    assert resolve_slow_seconds(1, 5) == 5 and resolve_slow_seconds(60, 5) == 60
    with pytest.raises(ConfigError, match="hang_seconds_slow_phases must be > 0"):
        DistArguments(hang_seconds_slow_phases=0)


def _train(tmp_path, slow_phases):
    config = tmp_path / "run.yaml"
    config.write_text(f"""
data: {{class_path: tests.recipes.IdData, init_args: {{n_train: 20, n_val: 4}}}}
module: {{class_path: tests.distributed.test_watchdog_phases.SlowValRecipe}}
trainer:
  epochs: 1
  train_batch_size: 10
  writers: [jsonl]
  output_dir: {tmp_path / 'out'}
  val_every_n_epochs: 1
  checkpoint: {{class_path: tests.distributed.test_watchdog_phases.SlowCheckpointer,
               at_epoch_end: true}}
  distributed: {{hang_seconds: 1, hang_seconds_slow_phases: {slow_phases}}}
""")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "sailfin", "train", str(config)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)


def test_a_slow_save_and_a_slow_on_end_val_epoch_are_within_the_slow_phase_limit(tmp_path):
    """hang_seconds 1: a 2.5 s save and a 2.5 s on_end_val_epoch pass under a 10 s limit
    for slow phases, and the run saved its checkpoint."""
    done = _train(tmp_path, 10)
    assert done.returncode == 0, done.stderr
    assert "hang watchdog" not in done.stderr
    assert (tmp_path / "out" / "checkpoints" / "step-00000002" / "manifest.json").exists()


def test_without_a_slow_phase_limit_the_report_names_the_phase_and_key(tmp_path):
    stopped = _train(tmp_path, "null")
    assert stopped.returncode == 75, stopped.stderr
    header = next(line for line in stopped.stderr.splitlines()
                  if "hang watchdog: no progress" in line)
    assert "(trainer.distributed.hang_seconds_slow_phases)" in header
    assert "(in validation)" in header  # validation comes first: on_end_val_epoch
