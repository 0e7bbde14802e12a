"""kill -9 from outside the process: at random steps, and in the middle of a save."""

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sailfin.checkpoint import DirectoryCheckpointer
from sailfin.cli import main
from sailfin.config import CheckpointArguments
from sailfin.distributed import DistEnv
from tests.checkpoint.helpers import final_weights, metric_lines

ROOT = Path(__file__).resolve().parents[2]

# 47 samples, global batch 10 in micro-batches of 5: 5 steps per epoch, the last one short.
CONFIG = """
data: {class_path: tests.recipes.IdData, init_args: {n_train: 47, n_val: 9}}
module:
  class_path: tests.checkpoint.helpers.SlowLinear
  init_args: {dropout: 0.3, momentum: 0.9, step_seconds: STEP_SECONDS}
trainer:
  epochs: 12
  train_batch_size: 10
  micro_batch_size: 5
  seed: 3
  log_every_n_steps: 1
  writers: [jsonl]
  output_dir: OUT
  checkpoint: {every_n_steps: 3, CHECKPOINT}
"""


def write_config(tmp_path, name, step_seconds=0.02, checkpoint="keep_last: 2"):
    text = (CONFIG.replace("OUT", str(tmp_path / name)).replace("STEP_SECONDS", str(step_seconds))
            .replace("CHECKPOINT", checkpoint))
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


def reference(tmp_path):
    assert main(["train", str(write_config(tmp_path, "ref", step_seconds=0))]) == 0
    return tmp_path / "ref"


def start(config, log, extra_env=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(extra_env or {})}
    with open(log, "ab") as fh:
        return subprocess.Popen([sys.executable, "-m", "sailfin", "train", str(config)],
                                cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)


def kill(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def latest_step(out):
    try:
        return int((out / "checkpoints" / "latest").read_text().split("-")[1])
    except (FileNotFoundError, IndexError, ValueError):
        return -1


def newest_complete(out):
    """The newest step whose checkpoint directory is in place with its manifest."""
    steps = [int(p.parent.name.split("-")[1])
             for p in (out / "checkpoints").glob("step-*/manifest.json")]
    return max(steps, default=-1)


def wait_for(predicate, proc, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            return False
        if time.monotonic() > deadline:
            raise TimeoutError("the training process made no progress")
        time.sleep(0.01)
    return True


def assert_same_run(out, ref):
    a, b = final_weights(out), final_weights(ref)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].equal(b[k]), f"{k} differs after resuming"
    assert metric_lines(out) == metric_lines(ref)


@pytest.mark.slow
def test_kill_9_at_random_steps_then_resume_is_bit_identical(tmp_path):
    ref = reference(tmp_path)
    config, out, log = write_config(tmp_path, "run"), tmp_path / "run", tmp_path / "run.log"
    seed = int(os.environ.get("SAILFIN_TEST_SEED") or time.time())  # a failure's seed reruns it
    rng = random.Random(seed)
    kills, proc = 0, None
    try:
        while True:
            proc = start(config, log)
            if kills == 3:
                assert proc.wait(timeout=300) == 0, log.read_text()
                break
            # The newest complete checkpoint: a kill between a save's commit and its move of
            # `latest` leaves `latest` behind it, and this start's recovery moves it there.
            before = max(latest_step(out), newest_complete(out))
            # Past a new checkpoint, then a random moment: mid-step, mid-save, anywhere.
            if wait_for(lambda: latest_step(out) > before, proc):
                time.sleep(rng.uniform(0.0, 0.4))
            if proc.poll() is not None:  # finished before the kill: nothing left to test
                break
            kill(proc)
            kills += 1
    finally:
        if proc is not None:
            kill(proc)
    text = log.read_text()
    resumed = [int(s) for s in re.findall(r"resuming from .* step (\d+),", text)]
    assert kills == 3, f"the run ended after {kills} kills (random seed {seed}):\n{text}"
    assert len(resumed) == 3 and resumed == sorted(resumed), (seed, text)
    assert_same_run(out, ref)


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True])
def test_kill_9_during_a_save_leaves_the_previous_checkpoint(tmp_path, async_save):
    ref = reference(tmp_path)
    checkpoint = ("class_path: tests.checkpoint.helpers.SlowCheckpointer, "
                  f"async_save: {str(async_save).lower()}, keep_last: 2")
    config = write_config(tmp_path, "run", checkpoint=checkpoint)
    out, log, markers = tmp_path / "run", tmp_path / "run.log", tmp_path / "markers"
    markers.mkdir()
    env = {"SAILFIN_TEST_SAVE_PAUSE": "60", "SAILFIN_TEST_SAVE_PAUSE_STEP": "6",
           "SAILFIN_TEST_SAVE_MARKER": str(markers)}
    proc = start(config, log, env)
    try:
        # The save of step 6 wrote its shards (small state included) and now sleeps before
        # its manifest: kill it there.
        assert wait_for(lambda: (markers / "saving-6").exists(), proc, timeout=120), \
            log.read_text()
        kill(proc)
    finally:
        kill(proc)
    root = out / "checkpoints"
    staged = root / ".tmp-step-00000006"
    assert (staged / "shards" / "__0_0.distcp").exists() and \
        (staged / "shards" / ".metadata").exists()
    assert not (staged / "manifest.json").exists()
    assert (root / "latest").read_text().strip() == "step-00000005"  # the epoch end
    ckpt = DirectoryCheckpointer(str(root), CheckpointArguments(), DistEnv())
    assert ckpt.load(ckpt.latest()).manifest["step"] == 5
    proc = start(config, log, {"SAILFIN_TEST_SAVE_MARKER": str(markers)})
    try:
        assert proc.wait(timeout=300) == 0, log.read_text()
    finally:
        kill(proc)
    assert "resuming from" in log.read_text() and not staged.exists()
    assert_same_run(out, ref)
