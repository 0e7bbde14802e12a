"""The digits demo config under the README's `torchrun --nproc-per-node 2` command, and the
torchrun command sailfin prints when a ddp run is started alone: both work as printed."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.harness import free_port, kill_tree

ROOT = Path(__file__).resolve().parents[2]


def run(argv: list[str], env: dict, timeout: float = 240) -> tuple[int, str]:
    proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        kill_tree(proc)
    return proc.returncode, out.decode(errors="replace")


@pytest.mark.slow
def test_the_printed_launch_hint_runs_the_digits_demo_on_two_processes(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "PET_MASTER_PORT": str(free_port())}  # torchrun's --master-port, as the env sets it
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    out_dir = tmp_path / "digits"
    argv = ["examples/digits/config.yaml", "--trainer.epochs", "2", "--trainer.backend",
            "ddp", "--trainer.output_dir", str(out_dir), "--trainer.progress", "none"]
    code, text = run([sys.executable, "-m", "sailfin", "train", *argv], env)
    assert code == 2, text
    hint = next(line.strip() for line in text.splitlines() if line.strip().startswith("torchrun"))
    assert hint == ("torchrun --nproc-per-node=2 -m sailfin train " + shlex.join(argv))
    command = shlex.split(hint)
    code, text = run([sys.executable, "-m", "torch.distributed.run", *command[1:]], env)
    assert code == 0, text[-3000:]
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_step"] == 46
    assert summary["val"]["accuracy"] > 0.8
