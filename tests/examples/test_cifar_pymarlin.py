"""PyMarlin's CIFAR-10 recipe, ported as the migration doc says, on sp and 2-process ddp."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from examples.cifar_pymarlin.recipe import CifarData
from sailfin.cli import main
from tests.distributed.harness import free_port, kill_tree

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "examples/cifar_pymarlin/config.yaml"
SMALL = ["--data.init_args.n_train", "320", "--data.init_args.n_val", "128",
         "--trainer.epochs", "2", "--trainer.writers", "[jsonl]", "--trainer.progress", "none"]


def test_synthetic_data_has_cifars_shapes():
    data = CifarData(n_train=8, n_val=4)
    x, y = data.get_train_dataset()[0]
    assert x.shape == (3, 32, 32) and 0 <= int(y) < 10
    assert len(data.get_val_dataset()) == 4


def test_the_recipe_trains_on_sp(tmp_path, capsys):
    out = tmp_path / "sp"
    assert main(["train", CONFIG, *SMALL, "--trainer.output_dir", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["global_step"] == 20 and summary["samples_seen"] == 640
    assert 0.0 <= summary["val"]["accuracy"] <= 1.0
    assert "validation accuracy" in capsys.readouterr().out


@pytest.mark.slow
def test_the_recipe_trains_on_two_ddp_processes_like_one(tmp_path):
    """The README's torchrun command; gpu_batch_size_limit 32 gives 16 per process."""
    assert main(["train", CONFIG, *SMALL, "--trainer.output_dir", str(tmp_path / "sp")]) == 0
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), "-m", "sailfin", "train", CONFIG, *SMALL,
         "--trainer.backend", "ddp", "--trainer.output_dir", str(tmp_path / "ddp")],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=240)
    finally:
        kill_tree(proc)
    assert proc.returncode == 0, output.decode(errors="replace")[-3000:]
    sp = json.loads((tmp_path / "sp" / "summary.json").read_text())
    ddp = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    assert ddp["world_size"] == 2 and ddp["global_step"] == sp["global_step"] == 20
    assert ddp["val"]["accuracy"] == pytest.approx(sp["val"]["accuracy"], abs=0.02)
    assert ddp["val"]["loss"] == pytest.approx(sp["val"]["loss"], rel=1e-3)
