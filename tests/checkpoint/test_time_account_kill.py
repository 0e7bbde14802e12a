"""The time account of a run killed twice (kill -9) and resumed: its components add up
to the wall time an outside clock measured, and the replayed time is the time of the
steps that were trained twice."""

import json
import os
import time

import pytest

from sailfin.logging.metrics_log import last_logged_step
from tests.checkpoint.test_kill import kill, latest_step, start, wait_for

CONFIG = """
data: {class_path: tests.recipes.IdData, init_args: {n_train: 100, n_val: 0}}
module:
  class_path: tests.checkpoint.helpers.SlowLinear
  init_args: {step_seconds: 0.05}
trainer:
  epochs: 8
  train_batch_size: 10
  micro_batch_size: 10
  seed: 3
  log_every_n_steps: 1
  writers: [jsonl]
  output_dir: OUT
  checkpoint: {every_n_steps: 8, at_epoch_end: false, keep_last: 2}
"""


@pytest.mark.slow
def test_killed_twice_the_account_sums_to_the_wall_and_replay_is_the_lost_steps(tmp_path):
    out, log = tmp_path / "run", tmp_path / "run.log"
    config = tmp_path / "run.yaml"
    config.write_text(CONFIG.replace("OUT", str(out)))
    reached = []  # how far each killed process had logged
    began = time.time()  # the outside clock
    proc = None
    try:
        for past in (16, 40):
            proc = start(config, log)
            # Past a checkpoint, then a few steps into the next interval: those are lost.
            assert wait_for(lambda: latest_step(out) >= past, proc), log.read_text()
            assert wait_for(lambda: (last_logged_step(str(out / "metrics.jsonl")) or 0)
                            >= latest_step(out) + 5, proc), log.read_text()
            kill(proc)
            reached.append(last_logged_step(str(out / "metrics.jsonl")))
        proc = start(config, log)
        assert proc.wait(timeout=300) == 0, log.read_text()
    finally:
        if proc is not None:
            kill(proc)
    ended = os.stat(out / "summary.json").st_mtime
    totals = json.loads((out / "summary.json").read_text())["time_account"]
    account = json.loads((out / "time_account.json").read_text())
    seconds, wall = totals["seconds"], totals["wall_seconds"]
    outside = ended - began
    assert totals["segments"] == 3 and totals["failures"] == 2, account
    assert abs(sum(seconds.values()) - wall) < 1e-3
    assert abs(wall - outside) <= 0.02 * outside, (wall, outside)
    # Steps trained twice: from each resumed checkpoint to where the killed process was.
    resumed = [seg["from_step"] for seg in account["segments"][1:]]
    twice = sum(r - s for r, s in zip(reached, resumed))
    assert twice >= 10, (reached, resumed)
    step_time = seconds["productive"] / 80  # 80 steps kept, each trained once in productive
    assert abs(seconds["replayed"] - twice * step_time) <= max(0.2 * twice * step_time,
                                                               2 * step_time), (
        seconds, twice, step_time)
    print(f"wall {wall:.2f} s (outside {outside:.2f} s), twice {twice} steps, replayed "
          f"{seconds['replayed']:.3f} s vs {twice * step_time:.3f} s: {seconds}")
    assert seconds["restart_gap"] > 0 and seconds["startup"] > 0
    assert all(seg["seconds"]["restart_gap"] > 0 for seg in account["segments"][1:])
