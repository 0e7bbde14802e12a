import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sailfin.distributed.process_group import attempt_prefix
from tests.distributed.harness import kill_tree

ROOT = Path(__file__).resolve().parents[2]


def test_attempt_prefix_changes_with_restart_and_run():
    a = attempt_prefix({"TORCHELASTIC_RUN_ID": "r1", "TORCHELASTIC_RESTART_COUNT": "0"})
    b = attempt_prefix({"TORCHELASTIC_RUN_ID": "r1", "TORCHELASTIC_RESTART_COUNT": "1"})
    c = attempt_prefix({"TORCHELASTIC_RUN_ID": "r2", "TORCHELASTIC_RESTART_COUNT": "0"})
    # A node joining starts a new round with the same restart count and a larger world.
    d = attempt_prefix({"TORCHELASTIC_RUN_ID": "r1", "TORCHELASTIC_RESTART_COUNT": "0",
                        "WORLD_SIZE": "4"})
    assert len({a, b, c, d}) == 4


def _wait_for(path: Path, proc: subprocess.Popen, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{path.name} never appeared (torchrun rc={proc.poll()})")
        time.sleep(0.05)
    time.sleep(0.3)  # let the worker get into its all-reduce loop


@pytest.mark.slow
def test_workers_killed_twice_rejoin_through_the_per_attempt_store(tmp_path):
    """torchrun restarts the group after SIGKILL; every restart must rejoin, not hang."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
           "--max-restarts=3", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
           "--monitor-interval=0.1", str(ROOT / "tests/distributed/elastic_worker.py"),
           str(tmp_path)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        for attempt in (0, 1):
            pid_file = tmp_path / f"pid-{attempt}-1"
            _wait_for(pid_file, proc, 60)
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
    finally:
        kill_tree(proc)
    assert proc.returncode == 0, out.decode(errors="replace")[-3000:]
    assert [(tmp_path / f"done-{r}").read_text() for r in (0, 1)] == ["2", "2"]


def test_without_the_agent_store_every_node_names_the_round_alike():
    """An agent whose workers did not fail keeps its restart count when its partner's
    failure starts a new round: the namespace must not depend on it."""
    a = attempt_prefix({"TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_RESTART_COUNT": "0",
                        "TORCHELASTIC_USE_AGENT_STORE": "False", "MASTER_PORT": "4100",
                        "WORLD_SIZE": "2"})
    b = attempt_prefix({"TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_RESTART_COUNT": "1",
                        "TORCHELASTIC_USE_AGENT_STORE": "False", "MASTER_PORT": "4100",
                        "WORLD_SIZE": "2"})
    assert a == b
