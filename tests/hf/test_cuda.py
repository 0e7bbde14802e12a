"""Hugging Face models (BERT, GPT-2, BART, each built from a config) on one CUDA device:
fp32 matches the CPU run, bf16 autocast and ``fsdp`` train from the same start to
nearby weights, and the final ``save_pretrained`` directory loads without sailfin.

Marked ``cuda``: they skip (saying why) where there is no CUDA device; ``make test-gpu``
runs them.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from sailfin import Trainer, seed_everything
from tests.hf.helpers import NO_DROPOUT, args, module

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.cuda

TASKS = ["classification", "causal_lm", "seq2seq"]


# dropout off: the CPU and CUDA generators draw different masks
DROPOUT_OFF = {**NO_DROPOUT, "seq2seq": {"dropout": 0.0}}


def weights(task, data_dir, out, **kw):
    seed_everything(0)
    with Trainer(module(task, data_dir, config_kw=DROPOUT_OFF[task]), args(out, **kw)) as trainer:
        summary = trainer.train()  # (the context closes fsdp's process group of one)
    assert summary["global_step"] == 4
    # the final save_pretrained file: whole tensors on the CPU whatever the backend held
    return {k: v.float() for k, v in load_file(str(out / "final" / "hf" / "model.safetensors")).items()}


def close(got, ref, tol):
    assert got.keys() == ref.keys()
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], rtol=tol, atol=tol, msg=key)


@pytest.mark.parametrize("task", TASKS)
def test_fp32_on_cuda_matches_the_cpu_run(task, data_dir, tmp_path):
    gpu = weights(task, data_dir, tmp_path / "gpu", device="cuda")
    cpu = weights(task, data_dir, tmp_path / "cpu", device="cpu")
    close(gpu, cpu, tol=1e-3)
    loaded = transformers.AutoConfig.from_pretrained(tmp_path / "gpu" / "final" / "hf")
    assert loaded.model_type == {"classification": "bert", "causal_lm": "gpt2",
                                 "seq2seq": "bart"}[task]


@pytest.mark.parametrize("backend", ["sp-amp", "fsdp", "fsdp-amp"])
@pytest.mark.parametrize("task", ["classification", "causal_lm"])
def test_bf16_and_fsdp_on_cuda_stay_near_fp32(task, backend, data_dir, tmp_path):
    if "amp" in backend and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bfloat16")
    extra = {"amp_dtype": "bfloat16"} if "amp" in backend else {}
    ref = weights(task, data_dir, tmp_path / "sp", device="cuda", backend="sp")
    got = weights(task, data_dir, tmp_path / backend, device="cuda", backend=backend, **extra)
    close(got, ref, tol=5e-2 if "amp" in backend else 1e-4)
    changed = [k for k in ref if k.endswith("weight") and not torch.equal(got[k], ref[k])]
    if backend == "fsdp":  # fp32 sharded: the same arithmetic, up to reduction order
        return
    assert changed, "bf16 autocast left every weight bit-identical to fp32: was it on?"


def test_the_frozen_base_checksum_on_cuda_is_the_cpus_one_chunk_at_a_time(monkeypatch):
    """The fingerprint of a base on the GPU: the CPU's checksum, with at most one chunk of
    it on the host at a time (each copy to the host is a chunk's size)."""
    from sailfin.trainer.checkpointing.frozen_base import tensor_crc32

    t = torch.randn(1024, 257, generator=torch.Generator().manual_seed(0))
    on_gpu = t.to("cuda", torch.bfloat16)
    sizes = []
    real_cpu = torch.Tensor.cpu

    def cpu(self, *a, **k):
        sizes.append(self.numel() * self.element_size())
        return real_cpu(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "cpu", cpu)
    got = tensor_crc32(on_gpu, chunk_bytes=4096)
    monkeypatch.undo()
    assert got == tensor_crc32(on_gpu.cpu())
    assert sizes and max(sizes) <= 4096 and sum(sizes) == on_gpu.numel() * 2
