"""A LoRA checkpoint holds the adapters and a fingerprint of the frozen base (a checksum of
each tensor's bytes): a base whose values moved (rows swapped, a tensor reversed or
transposed, two elements exchanged) is refused on resume and on init_from alike."""

import zlib

import pytest
import torch

from sailfin import Trainer
from sailfin.checkpoint import CheckpointError
from sailfin.trainer.checkpointing.frozen_base import (_legacy, fingerprint, mismatch,
                                                       tensor_crc32)
from tests.hf.helpers import args, module

pytest.importorskip("peft")

LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0}
RUN = dict(max_steps=2, checkpoint={"every_n_steps": 2})


def swap_rows(t):
    t[[0, 1]] = t[[1, 0]].clone()


def reverse(t):
    t.copy_(t.flip(0))


def transpose(t):
    t.copy_(t.t().clone())


def swap_two(t):
    flat = t.view(-1)
    flat[[0, 5]] = flat[[5, 0]].clone()


# (the base tensor, how it is changed): each keeps every per-tensor sum and sum of squares.
CHANGES = {"rows of wte swapped": ("transformer.wte.weight", swap_rows),
           "wpe reversed": ("transformer.wpe.weight", reverse),
           "c_proj transposed": ("transformer.h.0.attn.c_proj.weight", transpose),
           "two elements of c_attn swapped": ("transformer.h.1.attn.c_attn.base_layer.weight",
                                              swap_two)}


def lora(data_dir, change=None):
    from sailfin import seed_everything

    seed_everything(0)
    m = module("causal_lm", data_dir, peft=LORA)
    if change is not None:
        suffix, how = CHANGES[change]
        (p,) = [p for n, p in m.named_parameters() if n.endswith(suffix)]
        assert not p.requires_grad
        with torch.no_grad():
            before = p.detach().clone()
            how(p.data)
        assert not torch.equal(before, p) and p.shape == before.shape
    return m


@pytest.fixture(scope="module")
def saved_run(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora-run")
    Trainer(lora(data_dir), args(out, **RUN)).train()
    return out


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_reordered_base_is_refused_on_resume(saved_run, data_dir, change, tmp_path):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(saved_run, out)  # a run to continue, with another base
    trainer = Trainer(lora(data_dir, change), args(out, **{**RUN, "max_steps": 4}))
    with pytest.raises(CheckpointError, match="another frozen base: frozen parameter "
                                              f".*{CHANGES[change][0]} differs"):
        trainer.setup()
    trainer.close()


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_reordered_base_is_refused_on_init_from(saved_run, data_dir, change, tmp_path):
    ckpt = str(saved_run / "checkpoints")
    trainer = Trainer(lora(data_dir, change), args(tmp_path / "new", **RUN, init_from=ckpt))
    with pytest.raises(CheckpointError, match=r"trainer.init_from: checkpoint .* holds only "
                                              r"the parameters that train, and it was trained "
                                              f"on another frozen base: .*{CHANGES[change][0]}"):
        trainer.setup()
    trainer.close()


def test_the_same_base_resumes_and_serves_as_init_from(saved_run, data_dir, tmp_path):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(saved_run, out)
    trainer = Trainer(lora(data_dir), args(out, **{**RUN, "max_steps": 3}))
    trainer.train()
    assert trainer.resumed_from.name == "step-00000002"
    m = lora(data_dir)
    trainer = Trainer(m, args(tmp_path / "new", **RUN,
                              init_from=str(saved_run / "checkpoints")))
    trainer.setup()
    trainer.close()


def test_the_checksum_is_zlibs_over_the_bytes_in_chunks_or_whole():
    t = torch.randn(37, 11, generator=torch.Generator().manual_seed(0))
    whole = zlib.crc32(t.numpy().tobytes())
    assert tensor_crc32(t) == whole == tensor_crc32(t, chunk_bytes=12)
    half = t.to(torch.bfloat16)
    assert tensor_crc32(half, chunk_bytes=6) == zlib.crc32(half.view(torch.int16).numpy()
                                                            .tobytes())


def test_an_older_sum_fingerprint_is_still_checked_and_a_garbled_one_is_named(data_dir):
    m, other = lora(data_dir), lora(data_dir, "wpe reversed")
    old = _legacy(m)
    assert len(old[0]) == 5 and isinstance(old[0][3], float)
    assert mismatch(old, m) == "" and mismatch(fingerprint(m), m) == ""
    with torch.no_grad():  # what the sums do see: a value that changed
        (p,) = [p for n, p in other.named_parameters() if n.endswith("wte.weight")]
        p[0, 0] += 1.0
    assert "frozen parameter" in mismatch(old, other)
    assert "unreadable" in mismatch({"x": 1}, m) and "unreadable" in mismatch([[1, 2]], m)
