"""(#28) sp-amp on a CPU without native bf16: a one-line warning with the measured cost."""

import logging

import torch

from sailfin import Trainer
from sailfin.trainer.features import speed_checks as bf16_check
from sailfin.trainer.features.speed_checks import Bf16CpuCheck, native_bf16
from tests.recipes import IdData, LinearRecipe, args


def test_native_bf16_is_read_from_the_cpu_capability():
    none = frozenset({"avx2", "avx512f"})
    assert not native_bf16("AVX2", none) and not native_bf16("DEFAULT", none)
    assert native_bf16("AVX512_BF16", none) and native_bf16("AMX", none)
    # torch says AVX512 on an AMD EPYC whose kernel lists avx512_bf16: native.
    assert not native_bf16("AVX512", none)
    assert native_bf16("AVX512", none | {"avx512_bf16"})
    assert native_bf16("AVX2", none | {"amx_bf16"})


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\n"
                    "flags\t\t: fpu avx2 avx512f avx512_bf16\nbugs\t\t: sysret_ss_attrs\n")
    assert bf16_check.cpu_flags(str(info)) == {"fpu", "avx2", "avx512f", "avx512_bf16"}
    assert bf16_check.cpu_flags(str(tmp_path / "none")) == frozenset()


def run(tmp_path, backend):
    trainer = Trainer(LinearRecipe(IdData(20, 0)), args(tmp_path, backend=backend))
    trainer.train()
    trainer.close()
    return [c for c in trainer.callbacks if isinstance(c, Bf16CpuCheck)]


def test_sp_amp_on_an_emulating_cpu_warns_with_the_measured_cost(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(bf16_check, "cpu_flags", lambda: frozenset({"avx2"}))
    monkeypatch.setattr(bf16_check, "bf16_cost", lambda: 12.5)
    with caplog.at_level(logging.WARNING):
        checks = run(tmp_path / "amp", "sp-amp")
    assert len(checks) == 1
    assert checks[0].message == (
        "bf16 autocast on a CPU without native bf16 (torch reports AVX2, /proc/cpuinfo lists "
        "neither avx512_bf16 nor amx_bf16): one bf16 matmul took 12.5x as long as the fp32 "
        "one here; trainer.backend sp (fp32) is likely faster on this machine")
    assert checks[0].message in caplog.text
    assert run(tmp_path / "sp", "sp") == []  # fp32: no check at all


def test_a_cpu_with_native_bf16_is_not_warned_about(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512_BF16")
    assert run(tmp_path, "sp-amp")[0].message is None


def test_an_epyc_with_avx512_bf16_flags_is_not_warned_about(tmp_path, monkeypatch):
    """torch reports AVX512; the kernel lists avx512_bf16; bf16 measured 0.4x fp32."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(bf16_check, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    monkeypatch.setattr(bf16_check, "bf16_cost", lambda: 0.4)
    assert run(tmp_path, "sp-amp")[0].message is None


def test_bf16_measured_faster_is_never_called_slower(tmp_path, monkeypatch, caplog):
    """No flag says native bf16, but the matmul measured 0.4x fp32: no warning (the old
    one said '0.4x ... sp (fp32) is likely faster')."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(bf16_check, "cpu_flags", lambda: frozenset({"avx512f"}))
    monkeypatch.setattr(bf16_check, "bf16_cost", lambda: 0.4)
    with caplog.at_level(logging.WARNING):
        assert run(tmp_path, "sp-amp")[0].message is None
    assert "bf16" not in caplog.text


def test_the_cost_is_measured():
    assert bf16_check.bf16_cost(size=64, repeats=1) > 0
