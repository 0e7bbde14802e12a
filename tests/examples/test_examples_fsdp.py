"""Every example config trains under ``--trainer.backend fsdp`` on two processes (torchrun)
with no fsdp setting of its own, and starts from the weights ``sp`` starts from.

One step at learning rate 0 (``--module.init_args.lr 0``): the final weights are the
starting weights, compared bit for bit with the same step under ``sp``. The global batch
of these configs equals their micro-batch, so two processes need a smaller micro-batch;
it is given explicitly (``--trainer.micro_batch_size``) until sailfin lowers it itself.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from sailfin.cli import main
from tests.distributed.harness import free_port
from tests.examples.test_digits_ddp import ROOT, run

CONFIGS = ["examples/char_lm/config.yaml", "examples/hf/classify.yaml",
           "examples/hf/causal_lm.yaml", "examples/hf/seq2seq.yaml",
           "examples/hf/token_classification.yaml"]


def overrides(config: str, out: Path, data_dir: Path) -> list[str]:
    args = ["--trainer.max_steps", "1", "--module.init_args.lr", "0",
            "--trainer.output_dir", str(out), "--trainer.val_every_n_epochs", "0",
            "--trainer.sanity_val_batches", "0", "--trainer.progress", "none",
            "--trainer.writers", "[jsonl]"]
    if "/hf/" in config:  # the rows and tokenizer written once, read by both runs
        args += ["--data.init_args.out_dir", str(data_dir)]
    return args


@pytest.mark.slow  # a torchrun job of 2 processes per example
@pytest.mark.parametrize("config", CONFIGS)
def test_every_example_trains_under_fsdp_from_sps_weights(tmp_path, config, monkeypatch):
    monkeypatch.chdir(ROOT)
    data_dir = tmp_path / "hf-data"
    assert main(["train", config, *overrides(config, tmp_path / "sp", data_dir)]) == 0
    micro = yaml.safe_load(Path(ROOT, config).read_text())["trainer"]["train_batch_size"] // 2
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    code, text = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                      "--master-port", str(free_port()), "-m", "sailfin", "train", config,
                      *overrides(config, tmp_path / "fsdp", data_dir),
                      "--trainer.backend", "fsdp", "--trainer.micro_batch_size", str(micro)],
                     env, timeout=300)
    assert code == 0, text[-3000:]
    sp = load_file(str(tmp_path / "sp" / "final" / "model.safetensors"))
    fsdp = load_file(str(tmp_path / "fsdp" / "final" / "model.safetensors"))
    assert fsdp.keys() == sp.keys()
    for key, value in sp.items():
        assert torch.equal(fsdp[key], value), key
