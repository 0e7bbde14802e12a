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
