"""DP across processes: kill -9 and resume (sp-dp), and ddp-dp on 2 gloo processes."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sailfin import Trainer
from tests.checkpoint.helpers import final_weights, metric_lines
from tests.distributed.harness import errors, run_ranks
from tests.dp.recipes import dp_args, train_dp_rank
from tests.recipes import IdData, LinearRecipe

pytest.importorskip("opacus")
ROOT = Path(__file__).resolve().parents[2]

CONFIG = """
data: {class_path: tests.recipes.IdData, init_args: {n_train: 47, n_val: 9}}
module:
  class_path: tests.checkpoint.helpers.SlowLinear
  init_args: {momentum: 0.9, step_seconds: STEP}
trainer:
  backend: sp-dp
  epochs: 4
  train_batch_size: 10
  micro_batch_size: 5
  seed: 3
  log_every_n_steps: 1
  writers: [jsonl]
  progress: none
  output_dir: OUT
  checkpoint: {every_n_steps: 3}
  dp: {noise_multiplier: 1.1, max_grad_norm: 1.0}
"""


def config(tmp_path, name, step):
    path = tmp_path / f"{name}.yaml"
    path.write_text(CONFIG.replace("OUT", str(tmp_path / name)).replace("STEP", str(step)))
    return path


def summary(out):
    return json.loads((out / "summary.json").read_text())


def latest_step(out):
    try:
        return int((out / "checkpoints" / "latest").read_text().split("-")[1])
    except (FileNotFoundError, IndexError, ValueError):
        return -1


@pytest.mark.slow
def test_kill_9_mid_epoch_then_resume_gives_the_same_weights_and_epsilon(tmp_path):
    from sailfin.cli import main
    assert main(["train", str(config(tmp_path, "ref", 0))]) == 0
    ref, out, log = tmp_path / "ref", tmp_path / "run", tmp_path / "run.log"
    run = config(tmp_path, "run", 0.05)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log, "ab") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "sailfin", "train", str(run)], cwd=ROOT,
                                env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while latest_step(out) < 6 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.08)  # past the checkpoint of step 6: inside epoch 2 (5 steps each)
        assert proc.poll() is None, log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert not (out / "summary.json").exists()
    assert main(["train", str(run)]) == 0
    a, b = final_weights(out), final_weights(ref)
    assert all(a[k].equal(b[k]) for k in b)  # same batches, same noise: bit-identical
    assert summary(out)["privacy"] == summary(ref)["privacy"]
    assert metric_lines(out) == metric_lines(ref)


@pytest.mark.slow
def test_ddp_dp_on_two_processes_matches_sp_dp(tmp_path):
    """Every step draws the same Poisson batch whatever the world size, rank 0 adds the
    same noise: ddp-dp reports the same epsilon as sp-dp and ends with the same weights
    (up to the order of float sums)."""
    one = LinearRecipe(IdData(47, 9))
    single = Trainer(one, dp_args(tmp_path / "sp")).train()
    codes = run_ranks(train_dp_rank, 2, tmp_path, timeout=180)
    assert codes == [0, 0], errors(tmp_path)
    privacy = json.loads((tmp_path / "privacy.json").read_text())
    assert privacy == single["privacy"]
    weights = torch.load(tmp_path / "weights.pt")
    for k, v in one.state_dict().items():
        assert torch.allclose(weights[k], v, atol=1e-5), k
    seen = [json.loads((tmp_path / f"seen-{r}.json").read_text()) for r in range(2)]
    assert sorted(seen[0] + seen[1]) == sorted(i for ids in one.seen for i in ids)
