"""(#28) sp-amp on a CPU without native bf16: a one-line warning with the measured cost."""

import logging

import torch

from sailfin import Trainer
from sailfin.trainer.features import bf16_check
from sailfin.trainer.features.bf16_check import Bf16CpuCheck, native_bf16
from tests.recipes import IdData, LinearRecipe, args


def test_native_bf16_is_read_from_the_cpu_capability():
    assert not native_bf16("AVX2") and not native_bf16("DEFAULT")
    assert native_bf16("AVX512_BF16") and native_bf16("AMX")


def run(tmp_path, backend):
    trainer = Trainer(LinearRecipe(IdData(20, 0)), args(tmp_path, backend=backend))
    trainer.train()
    trainer.close()
    return [c for c in trainer.callbacks if isinstance(c, Bf16CpuCheck)]


def test_sp_amp_on_an_emulating_cpu_warns_with_the_measured_cost(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(bf16_check, "bf16_cost", lambda: 12.5)
    with caplog.at_level(logging.WARNING):
        checks = run(tmp_path / "amp", "sp-amp")
    assert len(checks) == 1
    assert checks[0].message == (
        "bf16 autocast on a CPU without native bf16 (AVX2): one bf16 matmul took 12.5x the "
        "fp32 one here; trainer.backend sp (fp32) is likely faster on this machine")
    assert checks[0].message in caplog.text
    assert run(tmp_path / "sp", "sp") == []  # fp32: no check at all


def test_a_cpu_with_native_bf16_is_not_warned_about(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512_BF16")
    assert run(tmp_path, "sp-amp")[0].message is None


def test_the_cost_is_measured():
    assert bf16_check.bf16_cost(size=64, repeats=1) > 0
