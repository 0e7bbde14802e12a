"""``trainer.checkpoint.every_n_steps: auto``: the interval follows what saves cost."""

import re
import time

import pytest

from sailfin import Trainer
from sailfin.checkpoint import DirectoryCheckpointer
from sailfin.config.errors import ConfigError
from sailfin.config import CheckpointArguments
from sailfin.trainer.checkpointing.auto_interval import (MEASURED_STEPS, WARMUP_STEPS,
                                                         young_daly_seconds)
from tests.checkpoint.helpers import SlowLinear
from tests.recipes import IdData, args


class DelayedCheckpointer(DirectoryCheckpointer):
    """Test-only storage whose every save takes 0.25 s longer (a slow disk)."""

    def save(self, snapshot):
        time.sleep(0.25)
        super().save(snapshot)


def saved_steps(out):
    return sorted(int(p.name.split("-")[1]) for p in (out / "checkpoints").glob("step-*"))


def run(tmp_path, name, class_path=None):
    out = tmp_path / name
    checkpoint = {"every_n_steps": "auto", "mtbf_hours": 0.0002, "keep_last": None,
                  "at_epoch_end": False, "class_path": class_path}
    module = SlowLinear(IdData(2000, 0), step_seconds=0.005)
    summary = Trainer(module, args(out, epochs=1, checkpoint=checkpoint)).train()
    return summary["checkpoint_interval"], saved_steps(out)


def test_slower_saves_give_a_longer_interval(tmp_path, capsys):
    fast, fast_steps = run(tmp_path, "fast")
    capsys.readouterr()
    slow, slow_steps = run(tmp_path, "slow", f"{__name__}.DelayedCheckpointer")
    said = capsys.readouterr().err
    assert slow["save_seconds"] > fast["save_seconds"] + 0.2
    assert slow["every_n_steps"] > fast["every_n_steps"]
    # The choice is the one in effect: the saves on disk are that far apart, and fewer.
    # The first save measures; the next comes as many steps later as was chosen then.
    first = int(re.search(r"a checkpoint every (\d+) step", said).group(1))
    assert slow_steps[1] - slow_steps[0] == first, (slow_steps, said)
    assert len(slow_steps) < len(fast_steps)
    # Young-Daly from the measured figures (0.72 s MTBF).
    tau = young_daly_seconds(slow["save_seconds"], 0.72)
    assert slow["every_n_steps"] == max(1, round(tau / slow["step_seconds"]))
    assert "trainer.checkpoint.every_n_steps auto: a checkpoint every" in said


class SlowFirstStep(SlowLinear):
    """The first step takes 0.3 s (a warm-up), the others 5 ms."""

    def train_step(self, global_step, batch, device):
        if global_step == 0:
            time.sleep(0.3)
        return super().train_step(global_step, batch, device)


def test_the_step_time_is_measured_on_steady_steps_not_the_first(tmp_path):
    """The digits demo's first step took 304 ms, its steady steps 22 ms: the first choice
    (61 steps) used the first step's time. The first choice now uses steady steps only."""
    checkpoint = {"every_n_steps": "auto", "mtbf_hours": 24, "keep_last": None,
                  "at_epoch_end": False}
    first = WARMUP_STEPS + MEASURED_STEPS
    module = SlowFirstStep(IdData(2000, 0), step_seconds=0.005)
    summary = Trainer(module, args(tmp_path, max_steps=first + 2,
                                   checkpoint=checkpoint)).train()
    choice = summary["checkpoint_interval"]
    assert choice["at_step"] == first and saved_steps(tmp_path)[0] == first
    assert 0.004 < choice["step_seconds"] < 0.1, choice  # 0.3 s / 5 + 5 ms with the first


def test_auto_and_mtbf_are_checked():
    assert CheckpointArguments(every_n_steps="auto").saves
    with pytest.raises(ConfigError, match="every_n_steps must be a number, auto or null"):
        CheckpointArguments(every_n_steps="often")
    with pytest.raises(ConfigError, match="mtbf_hours must be > 0"):
        CheckpointArguments(every_n_steps="auto", mtbf_hours=0)


def test_memory_snapshots_auto_snapshot_at_the_chosen_interval(tmp_path):
    from sailfin import Callback
    from sailfin.checkpoint import snapshot_dirs

    class Steps(Callback):
        def __init__(self):
            self.snapshots, self.chosen = [], []

        def on_save_end(self, trainer, kind, seconds):
            if kind == "snapshot":
                self.snapshots.append(trainer.global_step)

        def on_step_end(self, trainer):  # (before the auto callback: the previous step's choice)
            self.chosen.append(next(c for c in trainer.callbacks
                                    if hasattr(c, "interval")).interval.every)

    seen = Steps()
    checkpoint = {"at_epoch_end": False, "mtbf_hours": 0.0001,
                  "memory": {"every_n_steps": "auto", "dir": str(tmp_path / "shm")}}
    module = SlowLinear(IdData(600, 0), step_seconds=0.005)
    try:
        summary = Trainer(module, args(tmp_path, checkpoint=checkpoint),
                          callbacks=[seen]).train()
    finally:
        snapshot_dirs.clean(str(tmp_path))
    choice = summary["memory_snapshot_interval"]
    assert choice["every_n_steps"] >= 2 and seen.snapshots[0] == WARMUP_STEPS + MEASURED_STEPS
    # Each snapshot came as many steps after the previous one as was chosen then.
    for before, after in zip(seen.snapshots, seen.snapshots[1:]):
        assert after - before == seen.chosen[before], (seen.snapshots, seen.chosen)
    assert len(seen.snapshots) < 60
