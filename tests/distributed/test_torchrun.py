"""End to end under torchrun: the CLI on one node, two "nodes" on loopback, failures."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from sailfin.cli import main
from tests.distributed.harness import free_port, kill_tree

ROOT = Path(__file__).resolve().parents[2]

CONFIG = """
data: {class_path: tests.recipes.IdData, init_args: {n_train: 90, n_val: 13}}
module: {class_path: tests.recipes.LinearRecipe, init_args: {lr: 0.05, momentum: 0.9}}
trainer: {epochs: 2, train_batch_size: 16, micro_batch_size: 4, writers: [jsonl],
          log_every_n_steps: 2, output_dir: OUT, seed: 3}
"""


def write_config(tmp_path: Path, out: str) -> Path:
    path = tmp_path / f"{out}.yaml"
    path.write_text(CONFIG.replace("OUT", str(tmp_path / out)))
    return path


def torchrun(args: list[str], timeout: float = 180, env: dict | None = None
             ) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT,
                            start_new_session=True)


def finish(procs: list[subprocess.Popen], timeout: float = 180) -> list[tuple[int, str]]:
    results = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            results.append((p.returncode, out.decode(errors="replace")))
    finally:
        for p in procs:
            kill_tree(p)
    return results


def reference(tmp_path: Path) -> dict:
    assert main(["train", str(write_config(tmp_path, "sp"))]) == 0
    return load_file(str(tmp_path / "sp" / "final" / "model.safetensors"))


def assert_same_model(tmp_path: Path, out: str, ref: dict) -> None:
    got = load_file(str(tmp_path / out / "final" / "model.safetensors"))
    for k, v in ref.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6)
    summary = json.loads((tmp_path / out / "summary.json").read_text())
    assert summary["global_step"] == 12 and summary["val"]["count"] == 13


@pytest.mark.slow
def test_cli_under_torchrun_matches_one_process_with_the_default_backend(tmp_path):
    ref = reference(tmp_path)
    cfg = write_config(tmp_path, "ddp")
    [(code, out)] = finish([torchrun(["--nnodes=1", "--nproc-per-node=2",
                                      "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
                                      "-m", "sailfin", "train", str(cfg)])])
    assert code == 0, out[-3000:]
    assert_same_model(tmp_path, "ddp", ref)
    assert "intra-op thread(s) per process" in out
    # The config names no backend: under torchrun the default is ddp, as the peers do.
    assert "trainer.backend auto -> ddp (2 processes from torchrun)" in out


@pytest.mark.slow
def test_two_nodes_on_loopback(tmp_path):
    """Two torchrun agents (--nnodes=2, one process each) meet through c10d rendezvous."""
    ref = reference(tmp_path)
    cfg = write_config(tmp_path, "nodes")
    port = free_port()
    # The rendezvous store lives outside both agents, as a cluster's would: an agent
    # hosting it could end the job for the other by exiting first.
    store = dist.TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True,
                          wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
    common = ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
              f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=two-nodes",
              "--rdzv-conf=is_host=false",
              "-m", "sailfin", "train", str(cfg), "--trainer.backend", "ddp"]
    # Two agents on one host cannot share the rendezvous store with their workers.
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    try:
        results = finish([torchrun(common, env=env), torchrun(common, env=env)])
    finally:
        del store
    for code, out in results:
        assert code == 0, out[-3000:]
    assert_same_model(tmp_path, "nodes", ref)


@pytest.mark.slow
def test_a_failing_rank_fails_the_torchrun_job_with_its_error(tmp_path):
    cfg = tmp_path / "fail.yaml"
    cfg.write_text(CONFIG.replace("OUT", str(tmp_path / "fail")).replace(
        "tests.recipes.LinearRecipe", "tests.distributed.workers.FailingRecipe").replace(
        "{lr: 0.05, momentum: 0.9}", "{fail_rank: 1, fail_step: 2, rank: 1}"))
    [(code, out)] = finish([torchrun(["--nnodes=1", "--nproc-per-node=2",
                                      "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
                                      "-m", "sailfin", "train", str(cfg),
                                      "--trainer.backend", "ddp"])], timeout=120)
    assert code != 0
    assert "recipe failed on purpose at step 2" in out
