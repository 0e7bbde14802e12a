"""fsdp's final save in one process: the streamed file holds the gathered weights under the
names sp writes, tied weights once; on a GPU also with the shards offloaded to CPU."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from sailfin import Trainer
from tests.distributed.test_fsdp_final import Tied
from tests.recipes import IdData, args


def saved_and_gathered(tmp_path, backend, **kw):
    module = Tied(IdData(24, 0))
    with Trainer(module, args(tmp_path / backend, backend=backend, **kw)) as trainer:
        trainer.setup()
        path = trainer.backend.save_final_weights(
            module, str(tmp_path / backend / "w.safetensors"), True)
        gathered = {k: v.cpu() for k, v in trainer.backend.final_state_dict(module).items()}
    return load_file(path), gathered


def test_the_final_file_is_the_gathered_state_under_sp_names(tmp_path):
    sp, _ = saved_and_gathered(tmp_path, "sp")
    saved, gathered = saved_and_gathered(tmp_path, "fsdp", fsdp={"units": ["hidden"]})
    assert list(saved) == list(sp)  # the same tensors in the same order
    assert set(saved) == set(gathered) - {"head.weight"}  # tied: once, as emb.weight
    for key, value in saved.items():
        assert torch.equal(value, gathered[key]), key
        assert torch.equal(value, sp[key]), key  # the same start, untrained


@pytest.mark.cuda
@pytest.mark.parametrize("offload", [False, True])
def test_the_final_file_on_a_gpu_is_the_gathered_state(tmp_path, offload):
    saved, gathered = saved_and_gathered(tmp_path, "fsdp", device="cuda",
                                         fsdp={"units": ["hidden"], "cpu_offload": offload})
    assert set(saved) == set(gathered) - {"head.weight"}
    for key, value in saved.items():
        assert torch.equal(value, gathered[key]), key


@pytest.mark.parametrize("failing", ["write", "gather"])
def test_a_save_that_fails_midway_leaves_no_file(tmp_path, monkeypatch, failing):
    from sailfin.backends import fsdp as streamed_weights
    from sailfin.backends.weights_file import SafetensorsWriter

    calls = []

    def third_fails(original):
        def run(*a):
            calls.append(a[-1])
            if len(calls) == 3:
                raise OSError(28, "No space left on device")
            return original(*a)
        return run

    if failing == "write":  # rank 0's disk fills up
        monkeypatch.setattr(SafetensorsWriter, "write", third_fails(SafetensorsWriter.write))
    else:  # a collective fails
        monkeypatch.setattr(streamed_weights, "_full", third_fails(streamed_weights._full))
    module = Tied(IdData(24, 0))
    with Trainer(module, args(tmp_path / "run", backend="fsdp",
                              fsdp={"units": ["hidden"]})) as trainer:
        trainer.setup()
        with pytest.raises(OSError, match="No space left"):
            trainer.backend.save_final_weights(module, str(tmp_path / "out" / "w.safetensors"),
                                               True)
    assert len(calls) >= 3 and list((tmp_path / "out").iterdir()) == []
