"""PyMarlin's covid19_text_classification recipe, in PyMarlin's own form (an unannotated
``args`` read as attributes, a tuple val_step), on sp and 2-process ddp; then evaluated."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sailfin.cli import main
from tests.distributed.harness import free_port, kill_tree

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "examples/covid19_text_classification/config.yaml"
SMALL = ["--data.init_args.n_train", "320", "--data.init_args.n_val", "97",
         "--data.init_args.n_test", "51", "--trainer.epochs", "2",
         "--module.init_args.args.max_lr", "0.2",
         "--trainer.writers", "[jsonl]", "--trainer.progress", "none"]


def test_the_recipe_trains_on_sp_and_evaluates_its_test_split(tmp_path, capsys):
    out = tmp_path / "sp"
    assert main(["train", CONFIG, *SMALL, "--trainer.output_dir", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["global_step"] == 20 and summary["samples_seen"] == 640
    assert summary["val"]["accuracy"] > 0.3  # five classes: better than chance
    assert main(["evaluate", CONFIG, *SMALL, "--trainer.output_dir", str(out),
                 "--checkpoint", "best", "--split", "test"]) == 0
    result = json.loads((out / "eval-test.json").read_text())
    assert result["samples"] == 51 and 0.0 <= result["metrics"]["accuracy"] <= 1.0
    assert "evaluate test (51 samples" in capsys.readouterr().out


@pytest.mark.slow
def test_the_recipe_trains_on_two_ddp_processes_like_one(tmp_path):
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
    assert ddp["val"]["loss"] == pytest.approx(sp["val"]["loss"], rel=1e-3)
    assert ddp["val"]["accuracy"] == pytest.approx(sp["val"]["accuracy"], abs=0.02)
