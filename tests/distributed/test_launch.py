"""``sailfin launch``: torchrun's arguments, exit 75 when the job was preempted with a save.

Two CPU workers on loopback; SIGTERM to the launcher (what Kubernetes and Slurm
send) and to one worker; each run must exit 75 with a checkpoint of the step
where the workers stopped, and the same command again must resume from it.
A SIGTERM during set-up ends ``sailfin train`` with one line and 75, not -15.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from sailfin import signals
from sailfin.trainer.safety.preemption import PREEMPTED_EXIT_CODE
from tests.distributed.elastic_helpers import (ROOT, reached, stop, tail, wait, wait_until,
                                               write_config)


def launch(cfg, log, restarts=0):
    args = ["--nnodes=1", "--nproc-per-node=2", f"--max-restarts={restarts}",
            "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", "--monitor-interval=0.1",
            "-m", "sailfin", "train", str(cfg), "--trainer.backend", "ddp"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with open(log, "ab") as fh:
        return subprocess.Popen([sys.executable, "-m", "sailfin", "launch", *args], env=env,
                                stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True)


def test_the_exit_code_is_the_trainers():
    assert signals.PREEMPTED_EXIT_CODE == PREEMPTED_EXIT_CODE == 75


@pytest.mark.slow
@pytest.mark.parametrize("target", ["launcher", "worker"])
def test_sigterm_under_launch_exits_75_after_a_save(tmp_path, target):
    cfg = write_config(tmp_path, "job", every=100)  # no step saves: only the preemption one
    records, log = tmp_path / "job" / "records", tmp_path / "job.log"
    proc = launch(cfg, log)
    try:
        wait_until(lambda: reached(records, 0, "0-") >= 3, [proc], 180, [log], "step 3")
        if target == "launcher":
            proc.send_signal(signal.SIGTERM)
        else:
            [pid_file] = records.glob("pid-rank1-*")  # pid-rank1-<attempt>-pid<pid>
            os.kill(int(pid_file.read_text()), signal.SIGTERM)
        [code] = wait([proc], 120, [log])
    finally:
        stop(proc)
    text = log.read_text(errors="replace")
    assert code == 75, tail([log])
    assert "sailfin launch:" in text and "(exit code 75)" in text
    checkpoints = tmp_path / "job" / "run" / "checkpoints"
    latest = (checkpoints / "latest").read_text().strip()
    manifest = json.loads((checkpoints / latest / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["step"] >= 3


def test_sigterm_during_setup_is_one_line_and_75(tmp_path):
    """SIGTERM while the recipe is being built (before the trainer's handler exists)."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"""
data: {{class_path: tests.recipes.IdData, init_args: {{n_train: 20, n_val: 4}}}}
module: {{class_path: tests.recipes.SlowBuildRecipe, init_args: {{seconds: 30}}}}
trainer: {{epochs: 1, train_batch_size: 10, writers: [jsonl], output_dir: {tmp_path / 'out'}}}
""")
    ready = tmp_path / "building"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "SLOW_BUILD_MARKER": str(ready)}
    proc = subprocess.Popen([sys.executable, "-m", "sailfin", "train", str(cfg)], env=env,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 75, err
    assert "Traceback" not in err
    assert ("sailfin: stopped by SIGTERM during set-up, before the first step; nothing was "
            "lost") in err
    assert not (tmp_path / "out" / "checkpoints").exists()
