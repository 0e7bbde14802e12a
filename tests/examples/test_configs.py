"""Every example config (examples/*/config*.yaml, examples/hf/*.yaml) trains a step as
written: in one process, and (slow) on two processes under torchrun with the many-process
backend its docs name. Several set the micro-batch equal to the global batch, the natural
setting on one device; on two processes it is lowered to each rank's share, with one line
saying so, and the global batch stays.

The runs share one working directory (the configs' relative ``outputs/`` paths land
there): the hf examples write their rows and tokenizer once, as a user's would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sklearn  # noqa: F401  (sets KMP_* variables on import: before the environment check)
import yaml

from sailfin.cli import main
from tests.distributed.harness import free_port, kill_tree

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted(p.relative_to(ROOT).as_posix() for p in
                 [*ROOT.glob("examples/*/config*.yaml"), *ROOT.glob("examples/hf/*.yaml")])
# One step, one validation batch: the config's own model, data and settings otherwise.
ONE_STEP = ["--trainer.max_steps", "1", "--trainer.max_val_steps_per_epoch", "1",
            "--trainer.progress", "none"]
# The many-process backend each config's docs name (docs/hf.md: classify under fsdp).
TWO_PROCESSES = [(c, "ddp-dp" if "_dp" in c else "ddp") for c in CONFIGS] + \
    [("examples/hf/classify.yaml", "fsdp")]


def trainer_section(config: str) -> dict:
    return yaml.safe_load((ROOT / config).read_text())["trainer"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("examples")


def test_every_example_config_is_listed():
    assert len(CONFIGS) >= 9 and "examples/hf/classify.yaml" in CONFIGS
    assert "examples/char_lm/config.yaml" in CONFIGS


@pytest.mark.parametrize("config", CONFIGS)
def test_an_example_config_trains_a_step_in_one_process(config, workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    out = workdir / "one" / Path(config).with_suffix("").as_posix().replace("/", "-")
    assert main(["train", str(ROOT / config), *ONE_STEP, "--trainer.output_dir", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    section = trainer_section(config)
    assert summary["global_step"] == 1 and summary["world_size"] == 1
    # dp: a Poisson step's size is drawn, the global batch is its expectation
    assert summary["samples_seen"] == section["train_batch_size"] or "_dp" in config
    if section.get("micro_batch_size"):
        assert summary["micro_batch_size"] == section["micro_batch_size"]


def torchrun(args: list[str], cwd: Path, timeout: float = 400) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(free_port()), "-m", "sailfin", "train", *args]
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        kill_tree(proc)
    return proc.returncode, out.decode(errors="replace")


@pytest.mark.slow
@pytest.mark.parametrize("config,backend", TWO_PROCESSES)
def test_an_example_config_trains_a_step_on_two_processes(config, backend, workdir):
    out = workdir / "two" / f"{Path(config).with_suffix('').as_posix().replace('/', '-')}-{backend}"
    code, text = torchrun([str(ROOT / config), *ONE_STEP, "--trainer.backend", backend,
                           "--trainer.output_dir", str(out)], workdir)
    assert code == 0, text[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    section = trainer_section(config)
    global_batch = section["train_batch_size"]
    assert summary["world_size"] == 2 and summary["global_step"] == 1
    assert summary["samples_seen"] == global_batch or backend == "ddp-dp"  # Poisson steps
    micro = section.get("micro_batch_size")
    if micro and micro > global_batch // 2:  # one device's setting: lowered, said once
        assert summary["micro_batch_size"] == global_batch // 2
        said = [line for line in text.splitlines() if "lowered to" in line]
        assert said == [f"sailfin: trainer.micro_batch_size {micro} is more than each of the "
                        f"2 process(es)' share of trainer.train_batch_size {global_batch}: "
                        f"lowered to {global_batch // 2} (the global batch, and so the "
                        f"result, unchanged)"]
