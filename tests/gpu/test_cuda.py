"""On one CUDA device: each backend trains, and a checkpoint round trip resumes exactly.

Marked ``cuda``: they skip (saying why) where there is no CUDA device; ``make test-gpu``
runs them and then the benchmarks.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from sailfin import Trainer
from tests.backends.test_amp import OverflowAt
from tests.checkpoint.helpers import Crash, CrashAt
from tests.recipes import IdData, WideRecipe, args

pytestmark = pytest.mark.cuda

RUN = dict(epochs=2, train_batch_size=10, micro_batch_size=5, max_grad_norm=1.0,
           device="cuda", checkpoint={"every_n_steps": 3})


def train(tmp_path, name, crash_at=None, **kw):
    module = WideRecipe(IdData(47, 9), momentum=0.9)
    with Trainer(module, args(tmp_path / name, **{**RUN, **kw}),
                 callbacks=[CrashAt(crash_at)] if crash_at else []) as trainer:
        if crash_at:
            with pytest.raises(Crash):
                trainer.train()
            return None
        trainer.train()
        # where the weights live: cpu_offload keeps fsdp's shards in host memory
        offload = kw.get("fsdp", {}).get("cpu_offload", False)
        home = "cpu" if offload else kw.get("device", "cuda")
        assert next(module.parameters()).device.type == home
    return load_file(str(tmp_path / name / "final" / "model.safetensors"))


def close(a, b, tol=1e-5):
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=tol, atol=tol)


def test_sp_on_cuda_matches_cpu(tmp_path):
    close(train(tmp_path, "gpu", backend="sp"), train(tmp_path, "cpu", backend="sp",
                                                       device="cpu"), tol=1e-4)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_sp_amp_on_cuda(tmp_path, dtype):
    if dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bfloat16")
    ref = train(tmp_path, "fp32", backend="sp")
    got = train(tmp_path, dtype, backend="sp-amp", amp_dtype=dtype)
    if dtype == "bfloat16":
        close(got, ref, tol=5e-2)
    else:  # the grad scaler skips the first steps while it finds its scale: not comparable
        assert all(torch.isfinite(v).all() for v in got.values())
        assert any(not torch.equal(got[k], ref[k]) for k in ref)


def test_fp16_grad_scaler_skips_an_overflowing_step_on_cuda(tmp_path):
    module = OverflowAt(IdData(60, 0), bad_steps={1})
    with Trainer(module, args(tmp_path, backend="sp-amp", amp_dtype="float16",
                              device="cuda", max_steps=3)) as trainer:
        trainer.train()
        assert trainer.schedulers[0].last_epoch == 2  # one of three steps skipped
        assert trainer.backend.precision.scaler.get_scale() == 2.0 ** 15


def test_compile_on_cuda(tmp_path):
    close(train(tmp_path, "compiled", backend="sp", compile=True),
          train(tmp_path, "eager", backend="sp"), tol=1e-4)


@pytest.mark.parametrize("backend,extra", [("fsdp", {}), ("fsdp-amp", {"amp_dtype": "bfloat16"}),
                                           ("fsdp", {"fsdp": {"cpu_offload": True}})])
def test_fsdp_alone_on_cuda(tmp_path, backend, extra):
    if extra.get("amp_dtype") == "bfloat16" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bfloat16")
    ref = train(tmp_path, "sp", backend="sp")
    got = train(tmp_path, backend, backend=backend, **extra)
    close(got, ref, tol=5e-2 if backend == "fsdp-amp" else 1e-4)


@pytest.mark.parametrize("first,then", [("sp", "sp"), ("fsdp", "sp"), ("sp", "fsdp")])
def test_checkpoint_round_trip_on_cuda(tmp_path, first, then):
    ref = train(tmp_path, "ref", backend="sp")
    train(tmp_path, "run", crash_at=4, backend=first)
    close(train(tmp_path, "run", backend=then), ref, tol=1e-4)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["global_step"] == 10


@pytest.mark.parametrize("backend", ["sp", "fsdp"])
def test_async_saves_of_cuda_state_are_every_one_written_and_resume(tmp_path, backend):
    """Every async save stages CUDA tensors into pinned memory; on torch 2.11 the second
    save on one DCP stager failed (``KeyError: <class 'type'>``, seen on an H200), so a run
    with async_save stopped at its second checkpoint."""
    async_run = {"checkpoint": {"every_n_steps": 3, "async_save": True}}
    ref = train(tmp_path, "ref", backend="sp")
    train(tmp_path, "run", crash_at=8, backend=backend, **async_run)  # saves 3, 5 (epoch), 6
    saved = set(os.listdir(tmp_path / "run" / "checkpoints"))
    assert {"step-00000003", "step-00000005", "step-00000006"} <= saved
    close(train(tmp_path, "run", backend=backend, **async_run), ref, tol=1e-4)


def test_memory_snapshots_on_cuda_change_nothing_and_resume_bit_identical(tmp_path, capfd):
    """Snapshots copy CUDA tensors (weights, optimizer state, the CUDA generator) to host
    shared memory: the run with them ends as the run without, and one killed at step 7
    resumes from memory (dropout draws on the CUDA generator) to the same weights."""
    from tests.checkpoint.test_memory import Settle, recipe, trainer_args

    def run(name, crash_at=None, snapshots=True):
        model = recipe()
        kw = dict(device="cuda")
        a = (trainer_args(tmp_path / name, tmp_path / "shm", **kw) if snapshots else
             args(tmp_path / name, epochs=3, train_batch_size=10, micro_batch_size=5,
                  checkpoint={"at_epoch_end": False}, **kw))
        with Trainer(model, a, callbacks=[Settle()] + ([CrashAt(crash_at)] if crash_at else [])
                     if snapshots else []) as trainer:
            if crash_at:
                with pytest.raises(Crash):
                    trainer.train()
                return None
            trainer.train()
        return [p.detach().cpu() for p in model.parameters()]

    off = run("off", snapshots=False)
    on = run("on")
    assert all(torch.equal(a, b) for a, b in zip(on, off))
    run("run", crash_at=7)
    resumed = run("run")
    assert "resuming from memory, step 6" in capfd.readouterr().err
    assert all(torch.equal(a, b) for a, b in zip(resumed, off))
